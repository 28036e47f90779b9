"""Bayesian linear regression by SVI on mini-batches from a DataLoader, on one device.

    python examples/svi_single_device.py
    python examples/svi_single_device.py --cuda

Plain Pyro, written as Pyro's own examples are, and the starting point of the
"Convert your script" page (docs/getting-started/convert.md), which turns it
into a data-parallel script for any number of workers. The data set carries
each point's index, and the model's plate is sized by the whole data set with
the batch's indices as its subsample: every step's loss is then an estimate
of the ELBO of all the data, whatever the batch size. It knows nothing of
other workers: under torchrun each process would fit the data on its own.
"""

import argparse
import logging

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.utils.data import DataLoader, TensorDataset

logging.basicConfig(format="%(message)s", level=logging.INFO)

TRUE_WEIGHTS = [2.0, -1.0, 0.5]
TRUE_BIAS, TRUE_SIGMA = 1.0, 0.5


def model(index, x, y, size):
    """y ~ Normal(x @ weights + bias, sigma), for the points ``index`` of ``size``."""
    weights = pyro.sample("weights", dist.Normal(x.new_zeros(x.shape[1]), 10.0).to_event(1))
    bias = pyro.sample("bias", dist.Normal(x.new_zeros(()), 10.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("data", size, subsample=index):
        pyro.sample("obs", dist.Normal(x @ weights + bias, sigma), obs=y)


def make_data(size, seed):
    """A synthetic data set of (index, x, y), the same for every seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, len(TRUE_WEIGHTS), generator=generator)
    noise = torch.randn(size, generator=generator)
    y = x @ torch.tensor(TRUE_WEIGHTS) + TRUE_BIAS + TRUE_SIGMA * noise
    return TensorDataset(torch.arange(size), x, y)


def main(args):
    device = torch.device("cuda" if args.cuda else "cpu")
    pyro.set_rng_seed(args.seed)
    pyro.clear_param_store()

    dataset = make_data(args.num_data, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)

    guide = AutoNormal(model)
    optim = pyro.optim.ClippedAdam({"lr": args.learning_rate, "lrd": args.lr_decay})
    svi = SVI(model, guide, optim, Trace_ELBO())

    for epoch in range(args.num_epochs):
        epoch_loss = 0.0
        for index, x, y in loader:
            index, x, y = index.to(device), x.to(device), y.to(device)
            epoch_loss += svi.step(index, x, y, args.num_data)
        epoch_loss /= len(loader)
        logging.info(f"epoch {epoch:>3d}  loss {epoch_loss:.1f}")

    median = guide.median()
    weights = ", ".join(f"{w:.2f}" for w in median["weights"].tolist())
    logging.info(f"weights [{weights}]  bias {median['bias']:.2f}  sigma {median['sigma']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Bayesian linear regression by SVI")
    parser.add_argument("-n", "--num-epochs", default=10, type=int)
    parser.add_argument("--num-data", default=5000, type=int)
    parser.add_argument("-b", "--batch-size", default=100, type=int)
    parser.add_argument("-lr", "--learning-rate", default=0.05, type=float)
    parser.add_argument("--lr-decay", default=0.995, type=float, help="per step")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--cuda", action="store_true", default=False)
    args = parser.parse_args()
    main(args)
