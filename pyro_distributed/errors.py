"""The library's one exception class.

Input mistakes that a single process can see on its own (a wrong type, an
unknown keyword) raise :class:`TypeError` or :class:`ValueError`.
:class:`PyroDistributedError` is for everything that involves more than one
worker: workers that disagree, a worker that died, a collective that timed out.
Its message names the parameters and the workers involved.
"""


class PyroDistributedError(RuntimeError):
    """Raised when workers disagree, fail or time out.

    Every worker that takes part in the failing step raises it, with the same
    message, so that no worker is left blocked in a collective.

    Example::

        try:
            svi.step(batch)
        except PyroDistributedError as err:
            print(f"worker {pyro_distributed.rank()}: {err}")
            raise
    """
