"""`python -m moe_ckpt CHECKPOINT`: print what a checkpoint holds and the layout that wrote it."""

from __future__ import annotations

import argparse
import sys

from moe_ckpt.errors import CheckpointError
from moe_ckpt.summary import format_checkpoint, reports_damage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ckpt", description=__doc__.split(": ", 1)[1])
    parser.add_argument("checkpoint", help="a checkpoint folder (step-N), or a run folder with a `latest` pointer")
    args = parser.parse_args(argv)
    try:
        text = format_checkpoint(args.checkpoint)
    except CheckpointError as err:
        print(f"python -m moe_ckpt: {err}", file=sys.stderr)
        return 1
    print(text)
    return 1 if reports_damage(text) else 0  # a checkpoint that cannot be loaded fails a script's check


if __name__ == "__main__":
    sys.exit(main())
