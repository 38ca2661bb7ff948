"""rlhf: an instrumented, single-controller GRPO framework with built-in fault points."""

from setuptools import find_packages, setup

setup(
    name="rlhf",
    version="0.1.0",
    description="Instrumented single-controller GRPO framework with fault points and OpenTelemetry tracing",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["rlhf", "rlhf.*"]),
    python_requires=">=3.10",
    # torch is pinned by the install commands (constraints.txt), not here.
    install_requires=[
        "torch>=2.5",
        "transformers>=4.56,<6",
        "safetensors>=0.4",
        "pyyaml>=6",
        "aiohttp>=3.9",
        "tenacity>=8",
        "psutil>=5.9",
        "opentelemetry-api>=1.25",
        "opentelemetry-sdk>=1.25",
        "opentelemetry-exporter-otlp-proto-http>=1.25",  # also brings opentelemetry-proto and protobuf
        "matplotlib>=3.7",  # rlhf report
    ],
    extras_require={
        # msgspec, pybase64, ipython, requests: what sglang's client and API contract modules import
        # (tests/test_sglang_contract.py; sglang itself: pip install --no-deps -r tests/sglang-contract.txt)
        # your own data and rewards: Parquet files (pyarrow), Hugging Face datasets directories (datasets), the
        # math_equal reward (math-verify)
        "data": ["pyarrow>=14", "datasets>=2.16", "math-verify>=0.7"],
        # --logger tensorboard,wandb,mlflow: the experiment trackers' own libraries (each imported only when named)
        "trackers": ["tensorboard>=2.14", "wandb>=0.19", "mlflow-skinny>=2.14"],
        # megatron-core: the tests check its weight conversion on the CPU (its GPTModel runs only on CUDA); mkdocs:
        # tests/test_docs.py builds the docs site (mkdocs build --strict)
        "test": ["pytest>=8", "hypothesis>=6", "ruff>=0.5", "requests>=2.28", "msgspec>=0.18", "pybase64>=1.3",
                 "ipython>=8", "pyarrow>=14", "datasets>=2.16", "math-verify>=0.7", "megatron-core>=0.16",
                 "mkdocs>=1.6", "tensorboard>=2.14", "wandb>=0.19", "mlflow-skinny>=2.14",
                 "openai>=1.40", "skyrl-gym>=0.4"],
        # openai: tests/test_openai_contract.py drives the /v1 routes with its client; skyrl-gym: its environments
        # run unchanged (tests/test_env_adapters.py)
        # Never installed by the default commands: GPU-only and multi-GB.
        "gpu": ["sglang", "megatron-core>=0.16", "nvidia-ml-py"],
    },
    entry_points={"console_scripts": ["rlhf=rlhf.cli:main"]},
)
