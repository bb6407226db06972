"""Train, validate or sample a diffusion LM: ``python train.py fit --config configs/mdlm_tiny.yaml``.

Run ``python train.py --help`` (or ``python train.py fit --help``) for every option.
"""

from lit_dllm.cli import main

if __name__ == "__main__":
    main()
