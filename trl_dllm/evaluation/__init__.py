"""After training: the lm-evaluation-harness model (:mod:`.harness`) and merging an adapter into a full model in the
family's original layout (:mod:`.merge`), and how `trl-dllm eval` shares its prompts among processes (:mod:`.processes`).

Nothing is imported here, so ``import trl_dllm`` neither imports lm-eval nor registers anything with it: importing
:mod:`trl_dllm.evaluation.harness` registers the model as ``trl_dllm`` (and ``dllm``) in lm-eval's registry.
"""
