"""One warm forward of each named system on one seed case, bracketed for ``ncu
--profile-from-start off`` (three untimed calls first, then one inside
``cudaProfilerStart`` / ``Stop``), so a profile holds exactly one launch of each kernel.

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section LaunchStats \\
        python benchmarks/ncu_once.py hstu 32768 compilemask-cute,cudnn-fe
"""

from __future__ import annotations

import sys

import torch

from compilemask.tools.bench_systems import SYSTEMS, make_case


def main(argv: list[str]) -> int:
    name, n0, which = argv[0], int(argv[1]), argv[2].split(",")
    case = make_case(name, n0)
    by_name = {s.name: s for s in SYSTEMS}
    for system in which:
        runner = by_name[system].prepare(case, False)
        with torch.no_grad():
            for _ in range(3):
                runner.fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            runner.fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        print("profiled", system, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
