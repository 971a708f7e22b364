"""DiffusionGemma rollouts: all rows in one batch against one row at a time (how they ran before they were batched).

    python -m bench.bench_diffusion_gemma [--quick] [--repeats 3] [--out bench_out]

On the tiny DiffusionGemma checkpoint (:func:`trl_dllm.models.families.diffusion_gemma.build_tiny_model`, float32),
``rows`` left-padded chat prompts are decoded by
:func:`trl_dllm.models.families.diffusion_gemma.sampling.generate_diffusion_gemma` twice per repeat, interleaved: once with
every row in one call, once row by row (one call per row, without its padding). Each row draws from its own
generator, so both give the same completions, which the benchmark checks. Reports, medians over repeats:

- ``batched_seconds``, ``row_by_row_seconds``: wall time of one rollout of all rows;
- ``batched_over_row_by_row``: their ratio (target ``<= 0.5`` at 8 rows: on a tiny model a step's cost is its host
  work, which batching shares between the rows);
- ``identical``: whether the two rollouts' completions are equal, row for row;
- ``forwards``: batched decoder forwards, and the row forwards they decoded for a row still running.
"""

from __future__ import annotations

import torch

from bench.common import emit, environment, median, parser, ratio, setup, target, timed
from trl_dllm.models.families import diffusion_gemma as dg
from trl_dllm.models.families.diffusion_gemma.sampling import diffusion_gemma_options, generate_diffusion_gemma

QUESTIONS = ("sum 2 3", "what is the sum of 4 and 5 ?", "one", "what is 7 times 6 ?", "add 1 and 1",
             "how many apples ?", "two plus two", "what is the answer ?")  # fmt: skip


def prompts(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` chat prompts of the tiny tokenizer, left padded with its pad id 0, and their mask."""
    tokenizer = dg.build_tokenizer()
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(rows)]
    encoded = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) for chat in chats]
    width = max(map(len, encoded))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in encoded])
    return ids, (ids != 0).long()


def run(size=None, repeats: int = 3, rows: int = 8, gen_length: int = 64, diffusion_steps: int = 16) -> dict:
    model = dg.build_tiny_model()
    ids, mask = prompts(rows)
    options = diffusion_gemma_options(model, gen_length=gen_length, diffusion_steps=diffusion_steps,
                                      eos_token_ids=dg.GENERATION_EOS_IDS, eos_early_exit=False)  # fmt: skip

    def generators():
        return [torch.Generator().manual_seed(seed) for seed in range(rows)]

    def batched():
        return generate_diffusion_gemma(model, ids, mask, options=options, generator=generators())

    def row_by_row():
        gens = generators()
        return [generate_diffusion_gemma(model, ids[b][mask[b].bool()][None], None, options=options,
                                         generator=[gens[b]]).completion_ids[0] for b in range(rows)]  # fmt: skip

    with torch.no_grad():
        batched()  # warm-up
        together, apart, out, alone = [], [], None, None
        for _ in range(repeats):
            wall, _, out = timed(batched)
            together.append(wall)
            wall, _, alone = timed(row_by_row)
            apart.append(wall)
    value = ratio(median(together), median(apart))
    return {
        "environment": environment(size) if size is not None else {},
        "rows": rows, "gen_length": gen_length, "diffusion_steps": diffusion_steps,
        "batched_seconds": round(median(together), 4),
        "row_by_row_seconds": round(median(apart), 4),
        "batched_over_row_by_row": value,
        "identical": bool(torch.equal(out.completion_ids, torch.stack(alone))),
        "forwards": {"batched": out.num_forwards, "row_forwards": out.num_row_forwards},
        "targets": {"batched_over_row_by_row": target(value, 0.5, f"a rollout of {rows} rows in one batch over "
                                                      "one row at a time")},  # fmt: skip
    }  # fmt: skip


def main(argv=None) -> dict:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    size = setup(args)
    quick = dict(rows=4, gen_length=32, diffusion_steps=4) if args.quick else {}
    result = run(size, repeats=args.repeats or (1 if args.quick else 3), **quick)
    emit("diffusion_gemma", result, args.out)
    return result


if __name__ == "__main__":
    main()
