"""examples/train_gan.py: two models and two optimizers in one Trainer subclass (add_model), run as shipped."""

from __future__ import annotations

import importlib.util
import math
import runpy
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gan.py"


@pytest.fixture(scope="module")
def train_gan():
    spec = importlib.util.spec_from_file_location("example_train_gan", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.parameters()]


def _all_changed(before: list[torch.Tensor], model: torch.nn.Module) -> bool:
    return all(not torch.equal(old, new) for old, new in zip(before, model.parameters()))


def test_generated_samples_move_onto_the_ring(train_gan):
    torch.manual_seed(train_gan.SEED)  # the initial generator of train_gan(), to measure where training starts
    untrained = train_gan.create_generator()

    trainer = train_gan.train_gan(callbacks=())

    with torch.no_grad():
        start = untrained(trainer.monitor_noise)
        end = trainer.get_model()(trainer.monitor_noise)
    start_radius, end_radius = start.norm(dim=1).mean().item(), end.norm(dim=1).mean().item()
    assert abs(start_radius - train_gan.RING_RADIUS) > 1.0  # the untrained generator puts points near the centre
    assert abs(end_radius - train_gan.RING_RADIUS) < 0.5
    assert train_gan.ring_distance(end) < 0.5 * train_gan.ring_distance(start)
    assert trainer.run_history.get_latest_metric("ring_distance") == pytest.approx(train_gan.ring_distance(end))
    history = trainer.run_history
    for metric in ("train_loss_epoch", "discriminator_loss_epoch", "sample_radius", "ring_distance"):
        values = history.get_metric_values(metric)
        assert len(values) == 10 and all(math.isfinite(value) for value in values)


def test_both_models_train_twice(train_gan, tmp_path):
    """Both models train; a second run prepares the discriminator again."""
    torch.manual_seed(0)
    generator, discriminator = train_gan.create_generator(), train_gan.create_discriminator()
    trainer = train_gan.GANTrainer(
        generator,
        discriminator,
        generator_optimizer=torch.optim.Adam(generator.parameters(), lr=1e-3),
        discriminator_optimizer=torch.optim.Adam(discriminator.parameters(), lr=1e-3),
        callbacks=(),
    )
    dataset = train_gan.create_ring_dataset(256)

    for run in range(2):  # training_run_end unwrapped both models; the second run prepares them again
        generator_before, discriminator_before = _parameters(generator), _parameters(discriminator)
        trainer.train(dataset, num_epochs=1, per_device_batch_size=64)

        assert _all_changed(generator_before, generator), f"run {run}: the generator did not train"
        assert _all_changed(discriminator_before, discriminator), f"run {run}: the discriminator did not train"
        assert (
            trainer.discriminator is trainer.extra_models["discriminator"] is discriminator
        )  # unwrapped after the run
        discriminator_optimizer = trainer.extra_optimizers["discriminator"]
        assert type(discriminator_optimizer) is torch.optim.Adam  # out of Accelerate's wrapper
        assert discriminator_optimizer.state  # the Adam state was built by real steps
        assert math.isfinite(trainer.run_history.get_latest_metric("discriminator_loss_epoch"))

    trainer.save_checkpoint(tmp_path / "gan.pt")  # the discriminator and its Adam are in the file
    checkpoint = torch.load(tmp_path / "gan.pt", weights_only=True)
    assert all(
        torch.equal(checkpoint["extra_model_state_dicts"]["discriminator"][name], value)
        for name, value in discriminator.state_dict().items()
    )
    assert (
        checkpoint["extra_optimizer_state_dicts"]["discriminator"]["state"].keys()
        == discriminator_optimizer.state_dict()["state"].keys()
    )


def test_main_uses_the_command_line_arguments(train_gan):
    trainer = train_gan.main(["--num-epochs", "2", "--num-samples", "256", "--batch-size", "32", "--lr", "1e-3"])

    assert len(trainer.run_history.get_metric_values("ring_distance")) == 2
    assert trainer.run_config.train_per_device_batch_size == 32
    assert trainer.run_config.num_update_steps_per_epoch == 256 // 32
    assert (
        trainer.optimizer.param_groups[0]["lr"]
        == trainer.extra_optimizers["discriminator"].param_groups[0]["lr"]
        == 1e-3
    )


def test_runs_as_a_script_and_prints_the_history(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["train_gan.py", "--num-epochs", "2", "--num-samples", "256"])

    runpy.run_path(str(EXAMPLE), run_name="__main__")  # the `if __name__ == "__main__"` entry point

    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if "discriminator_loss_epoch" in line)
    assert lines[header].split() == ["discriminator_loss_epoch", "ring_distance", "sample_radius", "train_loss_epoch"]
    assert [line.split()[0] for line in lines[header + 2 :]] == ["1", "2"]  # one row per epoch, after "epoch"
