"""Context parallelism: one masked sequence over several ranks, balanced and fetched by the plan."""
