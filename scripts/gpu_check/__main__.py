"""The GPU check's commands (the package's docstring):

    python scripts/gpu_check [--report R] [--deadline S] [--kernels-s S] [--rows a,b] [--dry-run]
    python scripts/gpu_check nvfp4-backend                # the nvfp4 backend's own check
    python scripts/gpu_check nvfp4-cpu-half CHECKPOINT    # the nvfp4 row's CPU half (a child)

``--row NAME`` (a hidden option of the check) is a row's child process (``run.child``).
"""

import sys
from pathlib import Path

if not __package__:  # run by path: the package from the folder that holds it, as `python -m` would find it
    sys.path[0] = str(Path(__file__).resolve().parents[1])


def main(argv: list[str]) -> int:
    if argv[:1] == ["nvfp4-backend"]:
        from gpu_check import nvfp4_backend

        return nvfp4_backend.main()
    if argv[:1] == ["nvfp4-cpu-half"]:  # before anything imports transformers: it hides fla first
        from gpu_check import nvfp4

        return nvfp4.cpu_half(argv[1:])
    from gpu_check import run

    return run.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
