"""dsframework: DeepSpeed-based training of Hugging Face causal language models.

    pip install torch==2.13.0      # or any torch build for your machine; never pinned here
    pip install -e .[dev]
    dsf --help
"""
from setuptools import find_packages, setup

# Metric sinks beside metrics.jsonl (logging.tensorboard, logging.wandb) and `dsf plot`: each is
# imported only when used, so a training-only install can leave them out.
METRICS = ["tensorboard>=2.10", "wandb>=0.17", "matplotlib>=3.7"]

setup(
    name="dsframework",
    version="0.1.0",
    description="Plan, configure and run DeepSpeed training of Hugging Face causal LMs",
    packages=find_packages(include=["dsframework", "dsframework.*"]),
    python_requires=">=3.11",
    # torch is deliberately unpinned: install the build that matches your machine first.
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.16",
        "transformers>=4.46",
        "accelerate>=0.26",  # transformers' DeepSpeed integration (HfDeepSpeedConfig) needs it
        "peft>=0.13",  # LoRA adapters (model.lora); its torch requirement is met by the torch installed first
        "datasets>=3.0",
        "tokenizers>=0.20",
        "safetensors",
        "click>=8.1",
        "pyyaml>=6",
        "pydantic>=2.5",
        "tqdm",
    ],
    extras_require={"metrics": METRICS, "dev": ["pytest>=8", "pytest-timeout", "hypothesis", *METRICS]},
    entry_points={"console_scripts": ["dsf=dsframework.commands.cli:main"]},
)
