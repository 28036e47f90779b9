"""A variational autoencoder on scikit-learn's digits, trained with SVI on any number of workers.

One process:        python examples/vae_digits.py
Two workers:        torchrun --standalone --nproc-per-node 2 examples/vae_digits.py

The 1797 images ship with scikit-learn; pixels are scaled to [0, 1] and
modelled with a continuous Bernoulli likelihood (a proper density on [0, 1],
so the ELBO, in nats per image, can be positive). The last 297 images are
held out; the split is the same on every worker because the data set is.

The data-parallel pieces, all from ``pyro_distributed`` (``pd``):

* ``pd.init()`` joins the workers (a no-op in a plain process), and
  ``pd.set_rng_seed(seed)`` gives each worker its own guide noise, derived
  from one seed, so the workers' Monte Carlo estimates are independent.
* ``pd.ShardSampler`` hands each worker a disjoint share of the 1500 training
  images: every epoch, all workers draw the same permutation (seeded by
  ``seed`` and the epoch, set with ``sampler.set_epoch``) and worker r takes
  positions r, r + W, r + 2W, ... of it. Shards have equal lengths, so every
  worker takes the same number of steps per epoch. ``--batch-size`` is per
  worker: one step uses W * batch-size distinct images.
* The model's ``pyro.plate("data", 1500, subsample=indices)`` scales each
  worker's minibatch log-likelihood by 1500 / batch, so each worker's loss is
  an unbiased estimate of the full training ELBO, and so is the average.
* ``pd.DistributedOptimizer`` averages the gradients across workers before
  Adam steps, so all workers keep identical networks, and ``pd.all_mean`` turns
  the workers' losses into the global ELBO that worker 0 shows.
* ``pd.evaluate_loss`` computes the held-out ELBO once over the 297 images:
  each worker evaluates its own block of them (blocks of 149 and 148 on two
  workers), and the parts are added in one collective.
* With two or more workers, ``noise_scale=True`` measures the gradient noise
  scale B_simple at every step, from the norms that ride in the gradient
  sums; the figure shows it over training and the end of the run prints how
  many workers this batch size can use (``--no-noise-scale`` turns it off).
* ``pd.save_checkpoint`` is a collective: every worker calls it, worker 0
  writes. ``pd.load_checkpoint(path, optim)`` would resume from it.

Only worker 0 shows a progress bar, prints, and draws the figure.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from pyro.infer import SVI, Trace_ELBO
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import pyro_distributed as pd

HELD_OUT = 297
SIDE = 8  # the images are SIDE x SIDE pixels


def load_images() -> tuple[Tensor, Tensor]:
    """Training and held-out images, flattened to 64 pixels in [0, 1]."""
    pixels = torch.as_tensor(load_digits().data, dtype=torch.float32) / 16.0
    return pixels[:-HELD_OUT], pixels[-HELD_OUT:]


class Encoder(nn.Module):
    """q(z | x): a diagonal normal whose location and scale come from a small MLP."""

    def __init__(self, pixels: int, hidden: int, latent: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(pixels, hidden)
        self.loc = nn.Linear(hidden, latent)
        self.scale = nn.Linear(hidden, latent)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = F.softplus(self.hidden(x))
        return self.loc(h), F.softplus(self.scale(h)) + 1e-4


class Decoder(nn.Module):
    """The logits of p(x | z), one per pixel."""

    def __init__(self, latent: int, hidden: int, pixels: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(latent, hidden)
        self.logits = nn.Linear(hidden, pixels)

    def forward(self, z: Tensor) -> Tensor:
        return self.logits(F.softplus(self.hidden(z)))


class VAE(nn.Module):
    """Model and guide; ``indices`` says which of the ``size`` images ``x`` holds.

    ``pyro.module`` puts the networks' parameters in Pyro's param store, where
    SVI, the optimizer and the checkpoints find them.
    """

    def __init__(self, pixels: int, hidden: int, latent: int) -> None:
        super().__init__()
        self.latent = latent
        self.encoder = Encoder(pixels, hidden, latent)
        self.decoder = Decoder(latent, hidden, pixels)

    def model(self, x: Tensor, indices: Tensor, size: int) -> None:
        pyro.module("decoder", self.decoder)
        prior = dist.Normal(x.new_zeros(self.latent), 1.0).to_event(1)
        with pyro.plate("data", size, subsample=indices):
            z = pyro.sample("z", prior)
            likelihood = dist.ContinuousBernoulli(logits=self.decoder(z)).to_event(1)
            pyro.sample("x", likelihood, obs=x)

    def guide(self, x: Tensor, indices: Tensor, size: int) -> None:
        pyro.module("encoder", self.encoder)
        with pyro.plate("data", size, subsample=indices):
            loc, scale = self.encoder(x)
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    @torch.no_grad()
    def reconstruct(self, x: Tensor) -> Tensor:
        """Mean images decoded from the posterior means of ``x``'s latent codes."""
        return self.mean_image(self.encoder(x)[0])

    @torch.no_grad()
    def mean_image(self, z: Tensor) -> Tensor:
        """The mean of p(x | z), as images."""
        return dist.ContinuousBernoulli(logits=self.decoder(z)).mean


def evaluation_elbo(particles: int) -> Trace_ELBO:
    """The ELBO estimator for evaluation: all particles drawn at once, as one
    more batch dimension, which is several times faster than one by one."""
    return Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)


def held_out_elbo(vae: VAE, images: Tensor, particles: int) -> float:
    """The held-out ELBO per image, each image evaluated once, on one of the workers.

    The model's plate spans ``size`` images, the whole held-out set, so
    evaluate_loss weighs each worker's block by its share of the images.
    """
    data = (images, torch.arange(len(images), device=images.device))
    elbo = evaluation_elbo(particles)
    loss = pd.evaluate_loss(elbo, vae.model, vae.guide, data, size=len(images))
    return -loss / len(images)


def draw_noise_scale(axis: Axes, b_simple: list[float], advice: str) -> None:
    """B_simple over training, in worker batches, against the number of workers."""
    steps = torch.arange(1, len(b_simple) + 1)
    axis.plot(steps, b_simple, color="tab:orange", label="B_simple (moving average)")
    axis.axhline(pd.world_size(), color="gray", ls="--", lw=1, label="workers in this run")
    axis.set(xlabel="step", ylabel="worker batches", yscale="log")
    axis.set_title(f"Gradient noise scale: {advice}", fontsize=8, wrap=True)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize=8)


def draw_figure(
    path: Path,
    losses: list[float],
    vae: VAE,
    held_out: Tensor,
    seed: int,
    noise: tuple[list[float], str] | None = None,
) -> None:
    """Training curve (and noise scale), held-out digits and reconstructions, prior draws."""
    figure = Figure(figsize=(12, 4.6 if noise is None else 6.4), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subfigures(1, 2, width_ratios=[1, 1])

    if noise is None:
        curve = left.subplots()
    else:
        curve, below = left.subplots(2, 1, height_ratios=[3, 2])
        draw_noise_scale(below, *noise)
    steps = torch.arange(1, len(losses) + 1)
    curve.plot(steps, losses, lw=0.5, alpha=0.35, color="tab:blue", label="each step")
    window = max(1, len(losses) // 50)
    if losses:
        smooth = torch.tensor(losses).unfold(0, window, 1).mean(dim=1)
        curve.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"mean of {window} steps")
    curve.set(xlabel="step", ylabel="loss: -ELBO per training image (nats)")
    curve.set_title("Training loss, averaged over the workers")
    curve.grid(alpha=0.3)
    curve.legend(loc="upper right")

    columns = 10
    originals = held_out[: 2 * columns]
    reconstructions = vae.reconstruct(originals)
    prior_z = torch.randn(2 * columns, vae.latent, generator=torch.Generator().manual_seed(seed))
    prior_draws = vae.mean_image(prior_z.to(held_out.device))
    rows = [
        ("held-out", originals[:columns]),
        ("reconstructed", reconstructions[:columns]),
        ("held-out", originals[columns:]),
        ("reconstructed", reconstructions[columns:]),
        ("from the prior", prior_draws[:columns]),
        ("from the prior", prior_draws[columns:]),
    ]
    grid = right.subplots(len(rows), columns, gridspec_kw={"wspace": 0.05, "hspace": 0.1})
    right.suptitle("Held-out digits, their reconstructions, and decoded prior draws")
    for axes, (label, images) in zip(grid, rows, strict=True):
        for axis, image in zip(axes, images, strict=True):
            axis.imshow(image.view(SIDE, SIDE).cpu(), cmap="gray_r", vmin=0.0, vmax=1.0)
            axis.set_xticks([])
            axis.set_yticks([])
        axes[0].set_ylabel(label, rotation=0, ha="right", va="center")
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128, help="hidden units of each network")
    parser.add_argument("--latent", type=int, default=4, help="latent dimensions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--figure", type=Path, default=Path("vae_digits.png"))
    parser.add_argument("--checkpoint", type=Path, default=Path("vae_digits.pt"))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: each worker its GPU")
    parser.add_argument(
        "--noise-scale",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the gradient noise scale (default: with two or more workers)",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # the networks are tiny; one thread per worker is fastest
    pd.init()
    train, held_out = load_images()

    # Build the networks from the same seed on every worker, so they start
    # identical; DistributedOptimizer would otherwise copy worker 0's initial
    # values at the first step, after each worker computed its gradient at its own.
    torch.manual_seed(args.seed)
    vae = VAE(train.shape[1], args.hidden, args.latent).to(args.device)
    held_out = held_out.to(args.device)
    pd.set_rng_seed(args.seed)  # then independent guide noise on each worker

    dataset = TensorDataset(torch.arange(len(train)), train)
    sampler = pd.ShardSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    measure = pd.world_size() > 1 if args.noise_scale is None else args.noise_scale
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": args.lr}), noise_scale=measure)
    b_simple: list[float] = []  # the noise scale's estimate after every step
    svi = SVI(vae.model, vae.guide, optim, Trace_ELBO())

    total = args.epochs * len(loader)
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    if pd.is_main():
        print(
            f"training on {pd.world_size()} worker(s): {len(sampler)} of {len(train)} images "
            f"each, {args.batch_size} per step, {len(loader)} steps per epoch"
        )
    started = time.perf_counter()
    losses: list[float] = []  # the global loss (-ELBO) per training image, at every step
    bar = tqdm(total=total, desc="training", unit="step", disable=not pd.is_main())
    epoch = 0
    while len(losses) < total:
        epoch += 1
        sampler.set_epoch(epoch)  # the same new order on every worker
        for indices, images in itertools.islice(loader, total - len(losses)):
            images, indices = images.to(args.device), indices.to(args.device)
            loss = svi.step(images, indices, len(train))
            losses.append(pd.all_mean(loss) / len(train))  # the same on every worker
            if measure:  # no communication: read from the step's own sums
                b_simple.append(optim.noise_scale().b_simple)
            bar.update()
            progress = f"epoch {epoch}/{args.epochs}, ELBO {-losses[-1]:.2f}"
            bar.set_postfix_str(progress, refresh=False)
    bar.close()
    elapsed = time.perf_counter() - started

    evaluation_started = time.perf_counter()
    elbo = held_out_elbo(vae, held_out, particles=10)
    evaluation = time.perf_counter() - evaluation_started
    pd.save_checkpoint(args.checkpoint, optim)
    noise = optim.noise_scale(batch_size=args.batch_size) if measure else None
    if pd.is_main():
        curve = None if noise is None else (b_simple, noise.advice())
        draw_figure(args.figure, losses, vae, held_out, args.seed, curve)
        if noise is not None:
            print(noise)
        print(f"trained {len(losses)} steps in {elapsed:.1f} s")
        print(f"held-out ELBO per image: {elbo:.3f} nats")
        print(
            f"evaluated {len(held_out)} held-out images on {pd.world_size()} worker(s) "
            f"in {evaluation:.3f} s"
        )
        print(f"figure: {args.figure}")
        print(f"checkpoint: {args.checkpoint}")
    pd.shutdown()


if __name__ == "__main__":
    main()
