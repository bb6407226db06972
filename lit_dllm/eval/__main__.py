"""``python -m lit_dllm.eval <lm-eval arguments>``: the harness's command line with ``--model lit_dllm`` registered,
e.g. ``python -m lit_dllm.eval run --model lit_dllm --model_args checkpoint=last.ckpt --tasks gsm8k_local
--include_path <folder>``."""

import lit_dllm.eval  # noqa: F401  (registers the model)
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
