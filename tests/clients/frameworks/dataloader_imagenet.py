"""ImageNet-style training written for ``torch.utils.data.DataLoader``, in the manner
of pytorch/examples' ``imagenet/main.py``: ImageFolder datasets, a DistributedSampler
under torchrun (``set_epoch`` each epoch), DDP, the training and validation loops,
meters all-reduced after validation, and the leftover validation images run on one
more loader when the sampler's parts do not cover the split.

The tests run it as it is, and with its two ``DataLoader(...)`` statements turned into
``FeederLoader(...)`` ones (the dataset argument becomes the served name): nothing
else in it changes.

Run as ``python dataloader_imagenet.py DATA`` (``train/`` and ``val/`` in class
folders), alone or under torchrun (CPU ranks, gloo).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.utils.data import Subset

parser = argparse.ArgumentParser(description="ImageNet-style training")
parser.add_argument("data", help="path to dataset")
parser.add_argument("-a", "--arch", default="resnet18")
parser.add_argument("--epochs", default=2, type=int)
parser.add_argument("-b", "--batch-size", default=8, type=int)
parser.add_argument("--lr", default=0.05, type=float)
parser.add_argument("-j", "--workers", default=2, type=int)
parser.add_argument("--image-size", default=32, type=int)


class AverageMeter:
    def __init__(self) -> None:
        self.sum, self.count = 0.0, 0

    def update(self, val: float, n: int = 1) -> None:
        self.sum += val * n
        self.count += n

    def all_reduce(self) -> None:
        total = torch.tensor([self.sum, self.count], dtype=torch.float64)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()

    @property
    def avg(self) -> float:
        return self.sum / max(self.count, 1)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    with torch.no_grad():
        return (output.argmax(1) == target).float().mean().item() * 100.0


def main() -> None:
    args = parser.parse_args()
    args.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args.world_size, args.rank = 1, 0
    if args.distributed:
        dist.init_process_group("gloo")
        args.world_size, args.rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = models.__dict__[args.arch](num_classes=4)
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(),
                            transforms.ToTensor(), normalize]))
    val_dataset = datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([transforms.Resize(args.image_size * 8 // 7), transforms.CenterCrop(args.image_size),
                            transforms.ToTensor(), normalize]))
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    else:
        train_sampler = None
        val_sampler = None

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=True, sampler=train_sampler)

    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, sampler=val_sampler)

    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, args)
        validate(val_loader, model, criterion, epoch, args)


def train(train_loader, model, criterion, optimizer, epoch, args) -> None:
    data_time, losses, top1 = AverageMeter(), AverageMeter(), AverageMeter()
    model.train()
    end, batches = time.time(), 0
    for images, target in train_loader:
        data_time.update(time.time() - end)
        output = model(images)
        loss = criterion(output, target)
        losses.update(loss.item(), images.size(0))
        top1.update(accuracy(output, target), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batches += 1
        end = time.time()
    print(f"rank {args.rank} epoch {epoch} train batches {batches} of {len(train_loader)} "
          f"images {losses.count} loss {losses.avg:.4f}", flush=True)


def validate(val_loader, model, criterion, epoch, args) -> None:
    losses, top1 = AverageMeter(), AverageMeter()

    def run_validate(loader) -> None:
        with torch.no_grad():
            for images, target in loader:
                output = model(images)
                losses.update(criterion(output, target).item(), images.size(0))
                top1.update(accuracy(output, target), images.size(0))

    model.eval()
    run_validate(val_loader)
    if args.distributed:
        top1.all_reduce()
        losses.all_reduce()
    if args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset)):
        aux_val_dataset = Subset(val_loader.dataset,
                                 range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)))
        aux_val_loader = torch.utils.data.DataLoader(
            aux_val_dataset, batch_size=args.batch_size, shuffle=False,
            num_workers=args.workers, pin_memory=True)
        run_validate(aux_val_loader)
    print(f"rank {args.rank} epoch {epoch} * Acc@1 {top1.avg:.3f} images {int(top1.count)} "
          f"loss {losses.avg:.4f}", flush=True)


if __name__ == "__main__":
    main()
