"""A small local stand-in for torchvision's ``MNIST`` and ``transforms``, for the vendored pytorch-accelerated examples.

The examples run with no torchvision and no download: ``MNIST(root, download=True, transform=transforms.ToTensor())``
holds 60,000 samples, as MNIST's training set does (so the examples' ``random_split`` lines run unchanged), each a
1x28x28 float image in [0, 1] and an ``int`` label, with the ``class_to_idx`` of the ten digits. The images repeat
1,000 stored ones (3 MB), each its class's fixed pattern plus noise, so a model can learn them. Run the examples with
``PT_ACC_LIMIT_BATCHES`` set for a quick run.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import torch
from torch.utils.data import Dataset

_STORED_IMAGES = 1000


class MNIST(Dataset):
    """Takes torchvision's ``MNIST`` arguments; ``root`` and ``download`` are ignored (nothing is read or fetched)."""

    classes: ClassVar[list] = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six", "7 - seven", "8 - eight", "9 - nine"]

    def __init__(self, root=None, train: bool = True, transform=None, target_transform=None, download: bool = False):
        generator = torch.Generator().manual_seed(0 if train else 1)
        patterns = torch.rand(len(self.classes), 1, 28, 28, generator=generator)
        self.targets = torch.arange(_STORED_IMAGES) % len(self.classes)
        noise = 0.3 * torch.randn(_STORED_IMAGES, 1, 28, 28, generator=generator)
        self.images = (patterns[self.targets] + noise).clamp(0, 1)
        self.num_samples = 60000 if train else 10000
        self.transform, self.target_transform = transform, target_transform
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        image, target = self.images[index % _STORED_IMAGES], int(self.targets[index % _STORED_IMAGES])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class _ToTensor:
    """The images are tensors already: returns them as they are."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image


#: ``transforms.ToTensor()``, as the examples call it.
transforms = SimpleNamespace(ToTensor=_ToTensor)
