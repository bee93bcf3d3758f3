"""Data parallelism on real data: scikit-learn's handwritten digits (MindSpore's MNIST
tutorial, on the 8x8 digits set that ships inside scikit-learn).

    pip install scikit-learn        # or: pip install -e ".[examples]"
    python -m globaltensor.launch --nproc_per_node 2 examples/digits_data_parallel.py

Every rank builds the same model; `gt.nn.to_global(model, P, broadcast)` makes each
parameter a broadcast GlobalTensor (rank 0's initial values). `GlobalDataLoader` yields
each global batch `split(0)`: a rank reads only its own rows (the balanced split of the
batch). The loss is the mean over the whole global batch, so `loss.backward()` leaves in
every `p.grad` the gradient of that global mean, all-reduced by the framework: no manual
reduction, no wrapper. The run is the single-process run, whatever the number of ranks
(`--save` writes the final parameters for comparing runs).
"""
import argparse
import time

import torch
import torch.nn.functional as F

import globaltensor as gt
import globaltensor.utils.data  # noqa: F401  (until globaltensor/__init__ imports utils)
from globaltensor.utils.data import GlobalDataLoader


def load_digits(test_size, seed):
    """(train, test) TensorDatasets: 1797 8x8 images scaled to [0, 1], labels 0-9."""
    from sklearn.datasets import load_digits  # local data: no download
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - x.mean()) / x.std()  # standardised pixels
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:test_size], order[test_size:]
    return (torch.utils.data.TensorDataset(x[train], y[train]),
            torch.utils.data.TensorDataset(x[test], y[test]))


def make_model(hidden):
    """A small CNN: conv 8x8 -> pool 4x4 -> conv -> pool 2x2 -> MLP head."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10))


def evaluate(model, loader):
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum().full())  # a global count
            total += y.shape[0]
    return correct / total


def save(model, path, rank):
    """Write the parameters as plain tensors (torch.save) from rank 0."""
    state = {name: t.detach().full() for name, t in model.state_dict().items()}  # collective
    if rank == 0:
        torch.save(state, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch size")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--test-size", type=int, default=360)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-acc", type=float, default=0.9, help="fail below this test accuracy")
    ap.add_argument("--save", default=None,
                    help="write the final parameters (torch.save); a path holding {epoch} "
                         "gets them after every epoch")
    args = ap.parse_args()

    gt.manual_seed(args.seed)
    rank, world = gt.get_rank(), gt.get_world_size()
    P = gt.placement("cpu", ranks=list(range(world)))
    train_set, test_set = load_digits(args.test_size, args.seed)
    train = GlobalDataLoader(train_set, args.batch_size, P, shuffle=True, seed=args.seed)
    test = GlobalDataLoader(test_set, 256, P, shuffle=False)

    model = gt.nn.to_global(make_model(args.hidden), P, gt.sbp.broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"digits: {len(train_set)} train / {len(test_set)} test images, {world} ranks, "
              f"global batch {args.batch_size} ({len(train)} batches per epoch)")
    start = time.perf_counter()
    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        model.train()
        loss_sum = 0.0
        for x, y in train:                    # x: (B, 1, 8, 8) split(0); this rank's rows only
            loss = F.cross_entropy(model(x), y)  # mean over the global batch
            opt.zero_grad()
            loss.backward()                   # p.grad: the global gradient, on every rank
            opt.step()
            loss_sum += loss.detach().full().item() * y.shape[0]
        model.eval()
        acc = evaluate(model, test)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {loss_sum / len(train_set):.4f}  "
                  f"test acc {acc:.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
        if args.save and ("{epoch}" in args.save or epoch + 1 == args.epochs):
            save(model, args.save.format(epoch=epoch + 1), rank)
    if rank == 0:
        print(f"final test accuracy {acc:.4f} on {world} ranks")
    assert acc >= args.min_acc, f"test accuracy {acc:.4f} < {args.min_acc}"


if __name__ == "__main__":
    main()
    # Tear the process group down before the interpreter does: gloo can abort at exit
    # otherwise ("terminate called without an active exception").
    torch.distributed.destroy_process_group()
