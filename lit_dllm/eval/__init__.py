"""lm-evaluation-harness integration (``pip install 'lit_dllm[eval]'``); importing it registers the model ``lit_dllm``.

lm-eval 0.4.13 finds models only through its registry, filled by imports: ``python -m lm_eval run --model lit_dllm``
fails there with "no model for this name found". Run its command line through this package instead::

    python -m lit_dllm.eval run --model lit_dllm --model_args checkpoint=runs/mdlm_tiny/checkpoints/last.ckpt \\
        --tasks gsm8k_local --include_path <folder from gsm8k_task_dir> --device cpu --batch_size 8

or, in Python, ``import lit_dllm.eval`` before ``lm_eval.simple_evaluate(model="lit_dllm", ...)``, or pass a
:class:`LitDLLMEval` object as ``model``. lit_dllm also declares the model in the ``lm_eval.models`` entry-point group
(``pyproject.toml``), which lm-eval versions with plugin discovery read, so that ``lm_eval`` itself resolves
``--model lit_dllm`` there. :func:`gsm8k_task_dir` writes the harness's GSM8K task for a local jsonl.
"""

try:
    import lm_eval  # noqa: F401
except ImportError as err:
    raise ImportError("lit_dllm.eval needs lm-evaluation-harness: pip install 'lit_dllm[eval]'.") from err

from lit_dllm.eval.harness import LitDLLMEval, load_module
from lit_dllm.eval.local_tasks import TASKS_DIR, gsm8k_task_dir

__all__ = ["LitDLLMEval", "TASKS_DIR", "gsm8k_task_dir", "load_module"]
