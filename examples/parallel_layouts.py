"""A small causal language model trained under the layout its flags give, with training states that stop and resume.

The model is transformers' ``LlamaForCausalLM`` from a tiny config made here (no download), trained on generated token
sequences whose samples carry their ids. Layouts (docs/scaling.md, "Layouts"):

- ``--dp-replicate R --dp-shard S --tp T``: Accelerate's ``ParallelismConfig`` (FSDP2 x tensor parallel, HSDP, tensor
  parallel alone, plain FSDP2); ``R x S x T`` processes. The model is split by its own tensor-parallel plan.
- ``--deepspeed-stage Z``: DeepSpeed ZeRO stage 1, 2 or 3 (DeepSpeed installed).

It needs transformers 5 (``pip install "transformers>=5"``: it applies a model's own plan to an existing model).

On the CPU (gloo)::

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 4 examples/parallel_layouts.py --dp-shard 2 --tp 2 \\
        --steps 8 --save-dir states --stop-after 4
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 4 examples/parallel_layouts.py --dp-shard 2 --tp 2 \\
        --steps 8 --save-dir states --resume
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 4 examples/parallel_layouts.py --dp-shard 4 \\
        --steps 8 --save-dir states --resume --allow-changes
    torchrun --nproc_per_node 1 examples/parallel_layouts.py --deepspeed-stage 2 --steps 8 --save-dir ds --stop-after 4

On GPUs: ``accelerate launch --num_processes 4 examples/parallel_layouts.py --dp-shard 2 --tp 2 ...``.

The run ends by printing, on the main process, one line: ``LAYOUT_RESULT {"weights_sha256": ..., "samples": [...]}``:
the sha256 of the full float32 weights in name order, and the ids of the samples this run trained, one entry per
sample per data-parallel group. A run stopped by ``--stop-after`` and resumed with ``--resume`` ends with the weights
of an uninterrupted run, bit for bit, and the two runs' samples together are the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
from accelerate.utils import gather_object
from torch.utils.data import Dataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, StopTrainingError, TrainerCallback
from pytorch_accel_trainer.parallel.layout import layout_of
from pytorch_accel_trainer.parallel.sharded import get_full_model_state_dict

GLOBAL_BATCH, SEQUENCE, VOCAB, CLIP = 4, 8, 64, 1.0


class TokenSequences(Dataset):
    """``count`` generated sequences of token ids (the same for every seed of the run), each with its id."""

    def __init__(self, count: int):
        self.tokens = torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        row = self.tokens[index]
        return {"input_ids": row, "labels": row, "sample_id": index}


class LayoutTrainer(Trainer):
    """Notes the ids of the samples each micro-batch trains before the model sees the batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained_ids: list = []

    def calculate_train_batch_loss(self, batch) -> dict:
        self.trained_ids.extend(batch.pop("sample_id").tolist())
        return super().calculate_train_batch_loss(batch)


class StopAfter(TrainerCallback):
    """Stops the run after ``updates`` optimizer updates, as a preemption would: the state is saved as the run ends."""

    def __init__(self, updates: int):
        self.updates = updates

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed >= self.updates:
            raise StopTrainingError(f"stopped after {self.updates} updates (--stop-after)")


def make_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def accelerator_kwargs(args) -> dict:
    """The layout the flags give, as Accelerator arguments."""
    if args.deepspeed_stage is not None:
        from accelerate.utils import DeepSpeedPlugin

        os.environ.pop("ACCELERATE_USE_CPU", None)  # with it Accelerate runs plain DDP, not DeepSpeed
        # ZeRO-3 gathers the full weights for weights_sha256 only with zero3_save_16bit_model (float32 here: the
        # model's own dtype)
        plugin = DeepSpeedPlugin(zero_stage=args.deepspeed_stage, gradient_clipping=CLIP, zero3_save_16bit_model=True)
        return {"deepspeed_plugin": plugin}
    from accelerate.parallelism_config import ParallelismConfig

    sizes = {"dp_replicate_size": args.dp_replicate, "dp_shard_size": args.dp_shard, "tp_size": args.tp}
    return {"parallelism_config": ParallelismConfig(**sizes)}


def weights_sha256(trainer: Trainer) -> str:
    """The sha256 of the full float32 weights in name order (gathered on the main process: every process calls)."""
    state = get_full_model_state_dict(trainer.accelerator, trainer.model)
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def main(args) -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    callbacks: list = []
    if args.save_dir is not None:
        callbacks.append(SaveTrainingStateCallback(args.save_dir, save_every_n_steps=args.save_every))
    if args.stop_after is not None:
        callbacks.append(StopAfter(args.stop_after))
    trainer = LayoutTrainer(model, None, optimizer, callbacks=callbacks, accelerator_kwargs=accelerator_kwargs(args))
    layout = layout_of(trainer.accelerator)
    trainer.train(
        TokenSequences(args.steps * GLOBAL_BATCH),
        num_epochs=1,
        per_device_batch_size=GLOBAL_BATCH // layout.dp_size,
        gradient_clip_norm=CLIP,
        resume_from=args.save_dir if args.resume else None,
        allow_resume_changes=args.allow_changes,
    )
    digest = weights_sha256(trainer)
    samples = gather_object(trainer.trained_ids if layout.leads_model_group else [])
    if trainer.accelerator.is_main_process:
        print("LAYOUT_RESULT " + json.dumps({"weights_sha256": digest, "samples": samples}), flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp-replicate", type=int, default=1, help="data-parallel replicas (HSDP's outer dimension)")
    parser.add_argument("--dp-shard", type=int, default=1, help="data-parallel shards (FSDP2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes")
    parser.add_argument("--deepspeed-stage", type=int, choices=(1, 2, 3), help="DeepSpeed ZeRO stage instead")
    parser.add_argument("--steps", type=int, default=8, help="optimizer updates (one epoch)")
    parser.add_argument("--save-dir", help="a training state every --save-every updates and at a stop")
    parser.add_argument("--save-every", type=int, default=None, help="updates between training states")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after K updates, the state saved")
    parser.add_argument("--resume", action="store_true", help="resume from --save-dir")
    parser.add_argument("--allow-changes", action="store_true", help="resume on another layout")
    args = parser.parse_args(argv)
    if args.resume and args.save_dir is None:
        parser.error("--resume needs --save-dir, the folder of training states to resume from")
    return args


if __name__ == "__main__":
    main(parse_args())
