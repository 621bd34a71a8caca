"""Train a tiny GAN on a ring of 8 Gaussians: two models and two optimizers in one Trainer.

The pattern, for any run with more than one model or optimizer:

- The trainer's own ``model`` and ``optimizer`` are the generator's. Everything the trainer does by itself
  (``backward_step``, ``optimizer_step``, ``optimizer_zero_grad``, gradient accumulation, clipping, the scheduler,
  ``get_model()``) then applies to the generator, unchanged.
- The discriminator and its optimizer are registered with ``self.add_model("discriminator", ...)``. The trainer
  prepares them with its own in each run (same device, same processes, same mixed precision), holds them in
  ``extra_models["discriminator"]`` / ``extra_optimizers["discriminator"]``, and unwraps them at the end of the run.
- ``calculate_train_batch_loss`` first makes one discriminator update on the batch (``discriminator_step``, which
  calls ``self.update_extra_model("discriminator", loss)``: backward, the run's clipping, step, zero grad), then
  returns the generator's loss; the trainer back-propagates it and steps the generator as usual.

``save_checkpoint``, ``load_checkpoint``, training states and ``train(resume_from=...)`` hold both models and both
optimizers, and a resumed run continues both exactly. The discriminator steps on every batch (gradient accumulation
and the scheduler apply to the generator only). The example only trains (``trainer.evaluate()`` would run the
default evaluation hooks on the generator, which does not take data points). Each epoch records
``discriminator_loss_epoch`` (``train_loss_epoch`` is the generator's), and the mean radius of a fixed set of
generated samples and their mean distance to the ring (``sample_radius``, ``ring_distance``). In a few seconds on a
CPU the samples move from the centre onto the ring; like most plain GANs, this one then tends to settle on one or
two of the eight modes (the remedies for mode collapse are beyond this example)::

    python examples/train_gan.py
    accelerate launch examples/train_gan.py --num-epochs 30
"""

from __future__ import annotations

import argparse
import math
from typing import Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.tracking import LossTracker

SEED = 42
RING_RADIUS = 2.0
NUM_MODES = 8
NOISE_SIZE = 8
HIDDEN_SIZE = 128


def create_ring_dataset(num_samples: int = 2048, std: float = 0.05, seed: int = SEED) -> TensorDataset:
    """Points drawn from ``NUM_MODES`` Gaussians of standard deviation ``std`` evenly spaced on a circle."""
    generator = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, NUM_MODES, (num_samples,), generator=generator) * (2 * math.pi / NUM_MODES)
    centres = RING_RADIUS * torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    return TensorDataset(centres + std * torch.randn(num_samples, 2, generator=generator))


def create_generator() -> nn.Module:
    """Noise of ``NOISE_SIZE`` values -> a 2-D point."""
    return nn.Sequential(
        nn.Linear(NOISE_SIZE, HIDDEN_SIZE),
        nn.ReLU(),
        nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE),
        nn.ReLU(),
        nn.Linear(HIDDEN_SIZE, 2),
    )


def create_discriminator() -> nn.Module:
    """A 2-D point -> the logit that it is real."""
    return nn.Sequential(
        nn.Linear(2, HIDDEN_SIZE),
        nn.LeakyReLU(0.2),
        nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE),
        nn.LeakyReLU(0.2),
        nn.Linear(HIDDEN_SIZE, 1),
    )


def ring_distance(points: torch.Tensor) -> float:
    """The mean distance of ``points`` to the ring: 0 when every point lies on it."""
    return (points.norm(dim=1) - RING_RADIUS).abs().mean().item()


class GANTrainer(Trainer):
    """A Trainer whose model is the generator, with a discriminator trained alongside it.

    Args:
        generator: the trainer's ``model``.
        discriminator: returns one logit per point, "real" being 1.
        generator_optimizer: the trainer's ``optimizer``.
        discriminator_optimizer: an optimizer over the discriminator's parameters.
        num_monitor_samples: how many samples of fixed noise measure the generator at the end of each epoch.
        **kwargs: the other ``Trainer`` arguments (``callbacks``, ``seed``, ...).
    """

    def __init__(
        self,
        generator: nn.Module,
        discriminator: nn.Module,
        generator_optimizer: torch.optim.Optimizer,
        discriminator_optimizer: torch.optim.Optimizer,
        num_monitor_samples: int = 512,
        **kwargs,
    ):
        super().__init__(generator, loss_func=nn.BCEWithLogitsLoss(), optimizer=generator_optimizer, **kwargs)
        # prepared with the generator in each run, updated by update_extra_model, saved in checkpoints and states
        self.add_model("discriminator", discriminator, discriminator_optimizer)
        self.monitor_noise = torch.randn(num_monitor_samples, NOISE_SIZE, generator=torch.Generator().manual_seed(0))
        self._discriminator_losses = LossTracker()

    @property
    def discriminator(self) -> nn.Module:
        """The discriminator: prepared (on the device, in DistributedDataParallel with several processes) during a
        run, the module passed to ``__init__`` after it."""
        return self.extra_models["discriminator"]

    def training_run_start(self) -> None:
        self.monitor_noise = self.monitor_noise.to(self.device)

    def train_epoch_start(self) -> None:
        super().train_epoch_start()
        self.discriminator.train()
        self._discriminator_losses.reset()

    def calculate_train_batch_loss(self, batch) -> dict:
        real = batch[0]
        fake = self.model(torch.randn(real.size(0), NOISE_SIZE, device=self.device))
        self.discriminator_step(real, fake.detach())
        # the generator's loss: fakes the updated discriminator takes for real. Its backward pass also leaves
        # gradients on the discriminator, which the next update_extra_model zeroes before its own.
        generator_loss = self.loss_func(self.discriminator(fake), torch.ones(real.size(0), 1, device=self.device))
        return {"loss": generator_loss, "model_outputs": fake, "batch_size": real.size(0)}

    def discriminator_step(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        """Update the discriminator once on a batch of real and generated points, and track its loss.

        Real and fake points go through the discriminator in one forward pass: under DistributedDataParallel each
        forward pass must be followed by its backward pass.
        """
        points = torch.cat([real, fake])
        targets = torch.cat([torch.ones(real.size(0), 1), torch.zeros(fake.size(0), 1)]).to(self.device)
        loss = self.loss_func(self.discriminator(points), targets)
        self.update_extra_model("discriminator", loss)  # zero grad, backward, the run's clipping, step, zero grad
        self._discriminator_losses.update(loss, real.size(0))  # kept on the device: no sync per step

    def train_epoch_end(self) -> None:
        # the mean over every process's batches: one all-reduce and one host read per epoch
        average = self._discriminator_losses.reduce_average(
            lambda sums: self.accelerator.reduce(sums, "sum"), self.device
        )
        self.run_history.update_metric("discriminator_loss_epoch", average)
        with torch.no_grad():
            samples = self.model(self.monitor_noise)
        self.run_history.update_metric("sample_radius", samples.norm(dim=1).mean().item())
        self.run_history.update_metric("ring_distance", ring_distance(samples))


def train_gan(
    num_samples: int = 2048,
    num_epochs: int = 10,
    batch_size: int = 64,
    lr: float = 2e-4,
    callbacks: Iterable = DEFAULT_CALLBACKS,
    seed: int = SEED,
) -> GANTrainer:
    """Train a generator and a discriminator on the ring of Gaussians; returns the trainer."""
    torch.manual_seed(seed)  # the same initial weights on every run (the trainer seeds only from train() on)
    generator, discriminator = create_generator(), create_discriminator()
    trainer = GANTrainer(
        generator,
        discriminator,
        generator_optimizer=torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.5, 0.999)),
        discriminator_optimizer=torch.optim.Adam(discriminator.parameters(), lr=lr, betas=(0.5, 0.999)),
        callbacks=callbacks,
        seed=seed,
    )
    trainer.train(create_ring_dataset(num_samples), num_epochs=num_epochs, per_device_batch_size=batch_size)
    return trainer


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-epochs", type=int, default=10, help="training epochs (default: 10)")
    parser.add_argument("--num-samples", type=int, default=2048, help="points in the dataset (default: 2048)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per device (default: 64)")
    parser.add_argument("--lr", type=float, default=2e-4, help="learning rate of both optimizers (default: 2e-4)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> GANTrainer:
    """Train the GAN, print the history of each epoch, and return the trainer."""
    args = parse_args(argv)
    trainer = train_gan(args.num_samples, args.num_epochs, args.batch_size, args.lr)
    trainer.print(trainer.run_history.to_dataframe().to_string(float_format="{:.4f}".format))
    return trainer


if __name__ == "__main__":
    main()
