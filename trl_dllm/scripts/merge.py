"""`trl-dllm merge`: a LoRA adapter merged into its base model, written in the family's original layout and checked.

    trl-dllm merge --model_name_or_path outputs/run --output_dir outputs/run-merged [--dtype bfloat16]
    trl-dllm merge --model_name_or_path outputs/run --output_dir merged --push_to_hub --hub_model_id me/model

Prints the max |Δ| of the logits between the reloaded merged model and base + adapter (:mod:`trl_dllm.evaluation.merge`)
and exits with status 1 when it exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-dllm merge", description=__doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("--model_name_or_path", required=True, help="Adapter directory, checkpoint or model folder.")
    parser.add_argument("--output_dir", required=True, help="Where to write the merged model and tokenizer.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="Saved dtype.")
    parser.add_argument("--tolerance", type=float, default=None, help="Largest accepted max |Δ| of the logits.")
    parser.add_argument("--trust_remote_code", action="store_true", help="For families without a native class.")
    parser.add_argument("--push_to_hub", action="store_true", help="Upload the merged folder to the Hub.")
    parser.add_argument("--hub_model_id", default=None, help="Hub repository (default: the output_dir's name).")
    parser.add_argument("--hub_private_repo", action="store_true", help="Create the Hub repository as private.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import os

    from ..errors import UsageError
    from ..evaluation.merge import MergeCheckError, merge, push_to_hub

    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isdir(args.model_name_or_path) and args.model_name_or_path not in ("tiny", "tiny-block"):
        print(f"trl-dllm merge: error: model_name_or_path: no such directory: {args.model_name_or_path}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        report = merge(args.model_name_or_path, args.output_dir, dtype=args.dtype, tolerance=args.tolerance,
                       trust_remote_code=args.trust_remote_code)  # fmt: skip
    except (UsageError, ValueError) as err:  # bad input: nothing was written
        print(f"trl-dllm merge: error: {err}", file=sys.stderr)
        return 2
    except MergeCheckError as err:  # the merged model does not reproduce base + adapter
        print(f"trl-dllm merge: error: {err}", file=sys.stderr)
        return 1
    what = f"{report.adapter} merged into {report.base}" if report.adapter else report.base
    print(f"{what} → {report.output_dir} ({report.layout} layout, {report.dtype})")
    print(f"max |Δ logits| vs base + adapter: {report.max_abs_diff:.3g} (tolerance {report.tolerance:.3g})")
    if args.push_to_hub:
        repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
        print(f"Pushed to {push_to_hub(args.output_dir, repo_id, private=args.hub_private_repo or None)}")
    return 0
