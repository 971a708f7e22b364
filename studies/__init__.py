"""Research studies built on trl_dllm's CPU demo: the method comparison (`studies.compare`, `make compare`), the
many-seeds report (`studies.seeds_report`, `make seeds`), the instability in miniature (`studies.stability`,
`make stability`) and the rollout study (`studies.rollout_study`). Run them from a clone of the repository
(`python -m studies.<name>`); like `bench/`, this package is not part of the installed `trl_dllm` (docs/compare.md,
docs/demo.md)."""
