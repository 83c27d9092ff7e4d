"""transformers integration: ``attn_implementation="compilemask"``.

After :func:`register`, any transformers model that dispatches its attention through
``transformers.AttentionInterface`` (Llama, Mistral, Qwen, BERT, ... in transformers 5) runs its
self-attention with :func:`compilemask.attention`. The mask is not transformers' own: it is a
:class:`~compilemask.MaskPlan` given to the model call as the keyword ``compilemask_plan``, which
the model forwards, with its other keyword arguments, to every attention layer. Packed documents,
prefix-LM, sliding windows, shared prompts and every other mask of the catalogue work the same
way; the plan broadcasts over the batch unless its mask is per batch row.

Example::

    >>> import compilemask as cm
    >>> from compilemask.integrations import huggingface as cm_hf
    >>> cm_hf.register()
    'compilemask'
    >>> model = transformers.BertModel.from_pretrained(path, attn_implementation="compilemask")
    >>> input_ids, position_ids, plan = cm_hf.pack_documents(token_lists, causal=False)
    >>> out = model(input_ids=input_ids, position_ids=position_ids, compilemask_plan=plan)

Keywords read from the model call (all optional but the plan):

- ``compilemask_plan``: a MaskPlan compiled for the sequence length, or a callable
  ``plan_for(module) -> MaskPlan`` (e.g. to give sliding-window layers another plan than the
  full-attention ones: ``module.layer_idx`` names the layer), or a mask (``compilemask.masks``,
  the language; or a callable returning one): compiled for each call's lengths, the queries
  aligned bottom-right on the keys, so that decoding with transformers' KV cache works (steps
  with a cache run the forward-only decode path, docs/decode.md). ``generate()`` refuses
  keywords the model does not declare: give it the mask with :func:`use_mask` instead;
- ``compilemask_backend``: the ``backend`` of :func:`compilemask.attention` (default "auto").

What the integration refuses (an :class:`~compilemask.errors.InputError`, never wrong numbers):
no plan; a padding ``attention_mask`` with a zero in it (padding belongs in the plan: pack the
sequences instead); a 4-D mask; attention dropout while training; a KV cache longer than the
plan (a plan is compiled for one length: give a mask to generate with a cache).

transformers is imported lazily (it is the optional extra ``compilemask[hf]``).

Legend: B batch, Hq / Hkv query / key-value heads, N sequence length, D head_dim.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch

from ..api.functional import attention
from ..compiler.decode import step_plan
from ..compiler.pipeline import compile as compile_mask
from ..compiler.plan import MaskPlan
from ..errors import InputError
from ..language.ast import Mask
from ..masks import document

NAME = "compilemask"
PLAN_KWARG = "compilemask_plan"
#: the model config's attribute holding the mask text set by :func:`use_mask`
MASK_ATTR = "compilemask_mask"
BACKEND_KWARG = "compilemask_backend"


def compilemask_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"compilemask"`` in transformers'
    ``AttentionInterface``.

    Args:
        module: the calling attention layer (read for ``training``; handed to a plan callable).
        query: [B, Hq, N, D]; key, value: [B, Hkv, N, D] (GQA when Hkv < Hq).
        attention_mask: must be None (the mask comes from the plan; see :func:`register`).
        scaling: softmax scale (None: 1 / sqrt(D)).
        dropout: attention dropout probability; must be 0 while ``module.training``.
        **kwargs: the model call's keywords; ``compilemask_plan`` (required) and
            ``compilemask_backend`` are read, the others ignored.

    Returns:
        ``(attn_output [B, N, Hq, D], None)``: the layout transformers expects (attention weights
        are never materialised).

    Raises:
        InputError: no plan, a dense mask, dropout while training, or anything
            :func:`compilemask.attention` rejects (a plan for another length, head_dim, ...).
    """
    plan = kwargs.get(PLAN_KWARG)
    if plan is None:
        text = getattr(getattr(module, "config", None), MASK_ATTR, None)
        plan = _parsed(text) if isinstance(text, str) else None
    if plan is None:
        raise InputError(
            f"attn_implementation='{NAME}' needs the mask as a MaskPlan: call the model with "
            f"{PLAN_KWARG}=compilemask.compile(mask, seq_len) (got no {PLAN_KWARG} keyword)"
        )
    if not isinstance(plan, (MaskPlan, Mask)) and callable(plan):
        plan = plan(module)
    cache_lens = None
    if isinstance(plan, Mask):
        plan, cache_lens = _plan_of_mask(plan, query, key)
    if attention_mask is not None:
        raise InputError(
            f"attn_implementation='{NAME}' takes its mask from {PLAN_KWARG}, but the layer "
            f"received an attention_mask of shape {list(attention_mask.shape)}; drop the "
            f"attention_mask argument and put the mask (padding included) into the plan"
        )
    if dropout and module.training:
        raise InputError(
            f"attn_implementation='{NAME}' has no attention dropout, but the layer is training "
            f"with dropout={dropout}; set the config's attention dropout to 0 (BERT: "
            f"attention_probs_dropout_prob=0.0, Llama: attention_dropout=0.0) or call model.eval()"
        )
    out = attention(
        query, key, value, plan, scale=scaling, backend=kwargs.get(BACKEND_KWARG) or "auto",
        cache_seqlens=cache_lens,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_mask(model, mask: Mask) -> None:
    """Give every compilemask attention layer of ``model`` the mask ``mask`` when a call has no
    ``compilemask_plan`` keyword: what ``model.generate()`` needs (it refuses undeclared
    keywords). The mask is stored as its text in ``model.config.compilemask_mask`` (so the
    config still saves as JSON) and compiled per call for the call's lengths, bottom-right.

    Example::

        >>> cm_hf.use_mask(model, cm.masks.sliding_window(4096))
        >>> model.generate(input_ids, max_new_tokens=32, do_sample=False)

    Raises:
        InputError: ``mask`` is not a compilemask mask.
    """
    if not isinstance(mask, Mask):
        raise InputError(f"mask must be a compilemask mask, got {type(mask).__name__}")
    model.config.compilemask_mask = str(mask)


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> Mask:
    from ..language.parser import parse

    return parse(text)


def _plan_of_mask(mask: Mask, query: torch.Tensor, key: torch.Tensor):
    """``(plan, cache_seqlens)`` of ``mask`` for this call: a cached MaskPlan when the
    queries are the keys (prefill, training), else a decoding plan of the last ``Nq`` keys."""
    nq, nk = query.shape[2], key.shape[2]
    if nq == nk:
        return compile_mask(mask, nq, device=query.device), None
    lens = torch.full((query.shape[0],), nk, dtype=torch.int32, device=query.device)
    return step_plan(mask, lens, nq, kv_len=nk), lens


def compilemask_mask_interface(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask function registered as ``"compilemask"`` in ``transformers.AttentionMaskInterface``.

    transformers builds no mask for the compilemask attention (it returns None), but a padding
    mask that hides tokens would then be dropped silently: refuse it instead. An all-ones padding
    mask (what tokenizers return for unpadded input) is accepted and dropped.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise InputError(
            f"attn_implementation='{NAME}' cannot apply a padding attention_mask (it hides "
            f"{int((~attention_mask.bool()).sum())} tokens): pack the sequences without padding "
            f"(compilemask.integrations.huggingface.pack_documents) or put the padding into the "
            f"plan's mask"
        )
    return None


def register(name: str = NAME) -> str:
    """Register the compilemask attention (and its mask function) with transformers.

    Idempotent. Afterwards ``attn_implementation=name`` is accepted by ``from_pretrained``,
    ``from_config`` and ``model.set_attn_implementation``.

    Args:
        name: the attention implementation's name (default ``"compilemask"``).

    Returns:
        ``name``.

    Raises:
        ImportError: transformers is not installed (``pip install compilemask[hf]``).

    Example::

        >>> from compilemask.integrations.huggingface import register
        >>> model = AutoModelForCausalLM.from_config(config, attn_implementation=register())
    """
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "compilemask.integrations.huggingface needs transformers: pip install 'compilemask[hf]'"
        ) from err
    transformers.AttentionInterface.register(name, compilemask_attention_forward)
    mask_interface = getattr(transformers, "AttentionMaskInterface", None)
    if mask_interface is not None:
        mask_interface.register(name, compilemask_mask_interface)
    return name


def pack_documents(
    documents: Sequence[Sequence[int]],
    *,
    causal: bool = True,
    device: torch.device | str | None = None,
    **compile_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, MaskPlan]:
    """Pack token sequences into one row with a document mask.

    Args:
        documents: token-id lists, one per document (each non-empty).
        causal: ``document(lengths, causal=causal)``: True for decoders, False for
            bidirectional encoders (BERT).
        device: where the tensors and the plan live (None: CPU).
        **compile_kwargs: passed to :func:`compilemask.compile` (``block_m``, ``block_n``).

    Returns:
        ``(input_ids, position_ids, plan)``: int64 [1, N] token ids, int64 [1, N] positions that
        restart at 0 in each document, and the plan of ``document(lengths, causal)`` for N.

    Raises:
        InputError: ``documents`` is not a list of token-id lists, holds no document, an
            empty one, or a token id that is not an integer (a float or a bool).

    Example::

        >>> ids, pos, plan = pack_documents([[101, 7, 102], [101, 102]], causal=False)
        >>> pos.tolist()
        [[0, 1, 2, 0, 1]]
    """
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise InputError(
            f"documents must be a list of token-id lists, got {type(documents).__name__}"
        )
    if not documents:
        raise InputError("documents must hold at least one document, got none")
    for i, d in enumerate(documents):
        if isinstance(d, (str, bytes)) or not isinstance(d, (Sequence, torch.Tensor)):
            raise InputError(f"documents[{i}] must be a list of token ids, got {type(d).__name__}")
        if len(d) == 0:
            raise InputError(f"documents[{i}] is empty; every document needs a token")
    lengths = [len(d) for d in documents]
    mask = document(lengths, causal=causal)
    flat = [_token_id(t, i, j) for i, d in enumerate(documents) for j, t in enumerate(d)]
    input_ids = torch.tensor([flat], dtype=torch.int64, device=device)
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64, device=device) for n in lengths])
    plan = compile_mask(mask, len(flat), device=device, **compile_kwargs)
    return input_ids, position_ids[None], plan


def _token_id(t: object, i: int, j: int) -> int:
    """``documents[i][j]`` as an int: an integer (Python, numpy or a 0-dim integer tensor);
    a float or a bool is refused rather than truncated."""
    is_bool = isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool)
    if not is_bool:
        try:
            return operator.index(t)
        except TypeError:
            pass
    got = f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else f"{type(t).__name__} {t!r}"
    raise InputError(f"documents[{i}][{j}] must be an integer token id, got {got}")


def plan_for_layers(plans: dict[str, MaskPlan], layer_types: Sequence[str]) -> Callable:
    """A ``compilemask_plan`` callable giving each layer the plan of its type.

    For models that mix layer types (``config.layer_types``, e.g. ``"sliding_attention"`` and
    ``"full_attention"`` in Gemma / Qwen): ``plans`` maps each type to its plan.

    Example::

        >>> plan = plan_for_layers({"sliding_attention": cm.compile(masks.sliding_window(512), n),
        ...                         "full_attention": cm.compile(masks.causal(), n)},
        ...                        config.layer_types)
    """
    missing = sorted(set(layer_types) - set(plans))
    if missing:
        raise InputError(f"plan_for_layers has no plan for the layer types {missing}")

    def plan_for(module: torch.nn.Module) -> MaskPlan:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise InputError(
                f"{type(module).__name__} has no layer_idx: give one MaskPlan instead of "
                f"plan_for_layers"
            )
        return plans[layer_types[idx]]

    return plan_for
