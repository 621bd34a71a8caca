"""Trains a tiny MLP under two layouts of Accelerate's ParallelismConfig in one 4-process CPU launch (gloo), and
compares each with the same training on one process; every process writes what tests/test_layouts.py checks.

Usage: layouts_run.py OUTPUT_DIR, launched with ACCELERATE_USE_CPU=1 on 4 processes (the runs fsdp_tp then hsdp) or
2 (the run tp):

  tp       tp 2 alone (a plain multi-process run: Accelerate allows no FSDP without a dimension to shard), with
           evaluate() and predict() as fsdp_tp; the sizes from the environment that accelerate launch
           --parallelism_config_tp_size 2 sets (ACCELERATE_USE_PARALLELISM_CONFIG=true, PARALLELISM_CONFIG_TP_SIZE=2);
           then, with transformers 5, llama_tp: a tiny LlamaForCausalLM split by the default parallelize_model.
  fsdp_tp  dp_shard 2 x tp 2 (FSDP2 x tensor parallel; the MLP split by torch's parallelize_module in the Trainer's
           parallelize_model hook), 3 AdamW updates with clipping, then evaluate() and predict() of 10 samples.
  hsdp     dp_replicate 2 x dp_shard 2 (HSDP), 3 AdamW updates; the same Trainer code, no hook.

Each writes ``OUTPUT_DIR/<run>.rank<i>.json``: the sample ids of each training batch this process saw, its layout,
the parameter types, and (rank 0) the largest differences from the one-process reference.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from accelerate.parallelism_config import ParallelismConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.parallel.layout import layout_of

SAMPLES, EVAL_SAMPLES, GLOBAL_BATCH, LR, CLIP = 24, 10, 8, 1e-2, 1.0


class SplitMlpTrainer(Trainer):
    """The MLP's two layers split across the tensor-parallel processes, as a user overrides the hook."""

    def parallelize_model(self, model, device_mesh):
        return parallelize_module(model, device_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


class RecordBatches(TrainerCallback):
    """The sample ids (the batch's third element) of every training batch this process reads."""

    def __init__(self):
        self.train_ids, self.eval_ids, self.eval_ids_padded = [], [], []

    def on_train_step_end(self, trainer, batch, **kwargs):
        self.train_ids.append(batch[2].tolist())

    def on_eval_step_end(self, trainer, batch, **kwargs):
        self.eval_ids.append(trainer.gather_for_metrics(batch[2]).tolist())
        self.eval_ids_padded.append(trainer.gather(batch[2], padding_value=-1).tolist())


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def make_data(size, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=generator)
    return TensorDataset(x, torch.sin(x) * 2, torch.arange(size))


def reference():
    """One process, the global batch of 8 in order: the weights after 3 updates, the mean loss, eval loss, outputs."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y, _ = make_data(SAMPLES, 0).tensors
    losses = []
    for start in range(0, SAMPLES, GLOBAL_BATCH):
        loss = nn.functional.mse_loss(model(x[start : start + GLOBAL_BATCH]), y[start : start + GLOBAL_BATCH])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    ex, ey, _ = make_data(EVAL_SAMPLES, 1).tensors
    with torch.no_grad():
        outputs = model(ex)
    return model.state_dict(), sum(losses) / len(losses), nn.functional.mse_loss(outputs, ey).item(), outputs


def run(name, trainer_class, config, folder):
    model = make_model()
    recorder = RecordBatches()
    trainer = trainer_class(
        model,
        nn.functional.mse_loss,
        torch.optim.AdamW(model.parameters(), lr=LR),
        callbacks=[recorder],
        accelerator_kwargs=None if config is None else {"parallelism_config": config},
    )
    layout = layout_of(trainer.accelerator)
    try:
        trainer.add_model("extra", nn.Linear(2, 2))
        refused = None
    except RuntimeError as error:
        refused = str(error)
    per_rank = GLOBAL_BATCH // layout.dp_size
    train_dl = DataLoader(make_data(SAMPLES, 0), batch_size=per_rank, shuffle=False)
    eval_data = make_data(EVAL_SAMPLES, 1)
    trainer.train(train_dl, num_epochs=1, gradient_clip_norm=CLIP)
    train_loss = trainer.run_history.get_latest_metric("train_loss_epoch")
    result = {
        "layout": layout.as_fact(),
        "dp": [layout.dp_rank, layout.dp_size],
        "tp_rank": layout.tp_rank,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "param_types": sorted({type(parameter).__name__ for parameter in trainer.model.parameters()}),
        "train_ids": recorder.train_ids,
        "total_batch": trainer.run_config.train_total_batch_size,
        "add_model_refused": refused,
    }
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    result.update(exports_round_trip(trainer, full, folder / name))
    weights, mean_loss, eval_loss, outputs = reference()
    result["max_weight_diff"] = max((full[key] - weights[key]).abs().max().item() for key in weights)
    result["train_loss_diff"] = abs(train_loss - mean_loss)
    if layout.tp > 1:
        trainer.evaluate(eval_data, per_device_batch_size=4)
        result["eval_ids"], result["eval_ids_padded"] = recorder.eval_ids, recorder.eval_ids_padded
        result["eval_loss_diff"] = abs(trainer.run_history.get_latest_metric("evaluation_loss") - eval_loss)
        predictions = trainer.predict(eval_data, per_device_batch_size=4)
        result["predict_rows"] = int(predictions.shape[0])
        result["predict_max_diff"] = (predictions - outputs).abs().max().item()
    index = trainer.accelerator.process_index
    (folder / f"{name}.rank{index}.json").write_text(json.dumps(result))


def exports_round_trip(trainer, full: dict, stem: Path) -> dict:
    """save_weights and save_checkpoint write the full weights (and the optimizer state of the full shapes), gathered
    from the DTensors; load_checkpoint puts them back into each process's shards."""
    from safetensors.torch import load_file

    trainer.save_weights(stem.with_suffix(".safetensors"))
    trainer.save_checkpoint(stem.with_suffix(".pt"))
    checkpoint = torch.load(stem.with_suffix(".pt"), weights_only=True)
    saved = load_file(stem.with_suffix(".safetensors"))
    moments = checkpoint["optimizer_state_dict"]["state"]
    shapes = [list(tensor.shape) for tensor in full.values()]
    exports = {
        "weights_file_equal": sorted(saved) == sorted(full) and all(torch.equal(saved[k], full[k]) for k in full),
        "checkpoint_equal": all(torch.equal(checkpoint["model_state_dict"][k], full[k]) for k in full),
        "optimizer_full_shapes": [list(moments[i]["exp_avg"].shape) for i in sorted(moments)] == shapes,
    }
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.zero_()
    trainer.load_checkpoint(stem.with_suffix(".pt"))
    reloaded = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    exports["reloaded_equal"] = all(torch.equal(reloaded[k], full[k]) for k in full)
    return exports


def make_llama():
    """The tiny LlamaForCausalLM of examples/parallel_layouts.py (a config made there, no download)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "parallel_layouts.py"
    spec = importlib.util.spec_from_file_location("parallel_layouts", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.make_model()


def run_llama(folder):
    """A tiny LlamaForCausalLM split by the default parallelize_model (its own plan), 3 AdamW updates with clipping
    (its norm weights stay plain tensors), against one process: AdamW's first steps amplify float noise, hence the
    test's 1e-5."""
    tokens = torch.randint(0, 64, (12, 8), generator=torch.Generator().manual_seed(1))  # the example holds 8
    reference_model = make_llama()
    optimizer = torch.optim.AdamW(reference_model.parameters(), lr=1e-3)
    for start in range(0, 12, 4):
        reference_model(input_ids=tokens[start : start + 4], labels=tokens[start : start + 4]).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference_model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    model = make_llama()
    trainer = Trainer(model, None, torch.optim.AdamW(model.parameters(), lr=1e-3), callbacks=[])
    rows = [{"input_ids": row, "labels": row} for row in tokens]
    trainer.train(DataLoader(rows, batch_size=4, shuffle=False), num_epochs=1, gradient_clip_norm=CLIP)
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    weights = reference_model.state_dict()
    result = {"max_weight_diff": max((full[key] - weights[key]).abs().max().item() for key in weights)}
    result["param_types"] = sorted({type(parameter).__name__ for parameter in trainer.model.parameters()})
    (folder / f"llama_tp.rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))


def main(folder: Path, processes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if processes == 2:
        run("tp", SplitMlpTrainer, None, folder)  # from the environment, as accelerate launch --parallelism_config_*
        if importlib.util.find_spec("transformers") and importlib.util.find_spec("transformers.distributed"):
            run_llama(folder)  # transformers 5: a plan it applies to an existing model
        return
    run("fsdp_tp", SplitMlpTrainer, ParallelismConfig(dp_shard_size=2, tp_size=2), folder)
    run("hsdp", Trainer, ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), folder)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(os.environ["WORLD_SIZE"]))
