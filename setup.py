"""rlhf_mcore: a Megatron-Core based RL post-training trainer for LLMs (PPO, GRPO and relatives)."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
DATA_PACKAGES = ["rlhf_mcore.data.raw", "rlhf_mcore.data.raw.gsm8k"]  # directories of data files, no Python
# `rlhf_mcore/kernels` is a symlink to the top-level `kernels/`, a namespace package (no __init__.py: kernels/README.md
# says why), which find_packages does not list: named here, so installs from a wheel ship it too.
NAMESPACE_PACKAGES = ["rlhf_mcore.kernels"]

setup(
    name="rlhf_mcore",
    version="0.1.0",
    description="RL post-training (PPO, GRPO, ...) for LLMs on Megatron-Core",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The package is `rlhf_mcore.kernels` from a checkout and installed alike; the bare name `kernels` is Hugging Face's.
    # The vendored GSM8K copy (rlhf_mcore/data/raw/gsm8k: jsonl + LICENSE) is package data of its own directory,
    # listed as a (namespace) package: as "data/raw/gsm8k/*" of `rlhf_mcore`, setuptools warned ~40 lines on every
    # install that Python sees the directory as a package absent from `packages`.
    packages=find_packages(include=["rlhf_mcore", "rlhf_mcore.*"]) + NAMESPACE_PACKAGES + DATA_PACKAGES,
    package_data={"rlhf_mcore.kernels": ["README.md"], "rlhf_mcore.data.raw.gsm8k": ["*.jsonl", "LICENSE"]},
    install_requires=[
        # A CPU wheel of torch is enough for development; any CUDA build in range works on GPU.
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "omegaconf>=2.4",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "datasets>=3.0",
        "pyarrow>=15",
        "numpy>=1.26",
        "tqdm>=4.66",
        "math-verify>=0.7",
        "tensorboard>=2.16",
        "psutil>=5.9",  # megatron dist_checkpointing's writer processes need it
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]>=2.0"],
        "sglang": ["sglang>=0.5.3"],  # rollout/sglang_backend.SGLANG_MIN_VERSION (sampling_seed)
        "triton": ["triton>=3.2"],
        "wandb": ["wandb>=0.18"],
        "plot": ["matplotlib>=3.7"],  # launch/plot_metrics.py and the curves train.py draws at its end
        # trl: the TRL peer benchmark's tiny form runs in the tests (pure Python; accelerate is its one extra need)
        # peft: tests/test_lora.py checks the LoRA adapters against it (the run itself writes PEFT files without it)
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.8", "ruff>=0.6", "triton>=3.2", "trl>=1.16",
                "accelerate>=1.10.1", "peft>=0.13", "matplotlib>=3.7"],
    },
    entry_points={},
)
