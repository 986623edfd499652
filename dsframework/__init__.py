"""dsframework: plan, configure and run DeepSpeed training of Hugging Face causal LMs.

    dsf config --zero-stage 2 --precision bf16 --world-size 8 --global-batch 256 -o ds.json
    deepspeed --num_gpus 2 $(which dsf) train launch/examples/tiny.yaml
    dsf export runs/tiny/checkpoints runs/tiny/hf
"""

__version__ = "0.1.0"
