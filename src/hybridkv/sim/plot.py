"""Plots of simulation results (needs the ``sim`` extra: matplotlib)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.sim.simulator import SimResult


def require_matplotlib() -> None:
    """Raise ``InvalidInputError`` naming the extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise InvalidInputError("--plot needs matplotlib: pip install 'hybridkv[sim]'") from exc


def plot_figure(results: list[tuple[str, SimResult]]) -> Any:
    """The matplotlib figure of ``plot_results`` (the caller closes it)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (ax_usage, ax_hit, ax_ttft) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, res in results:
        name = label or res.summary["retention"]
        ts = [t for t, _, _ in res.timeline]
        ax_usage.plot(ts, [u * 100 for _, u, _ in res.timeline], label=name)
        ax_hit.plot(ts, [h * 100 for _, _, h in res.timeline], label=name)
        n = len(res.ttfts)
        if n:
            ax_ttft.plot(res.ttfts, [(i + 1) / n for i in range(n)], label=name)
    ax_usage.set(title="KV usage", xlabel="simulated time (s)", ylabel="% of blocks held")
    ax_hit.set(title="prefix-hit rate (cumulative)", xlabel="simulated time (s)", ylabel="% of prompt tokens")
    ax_ttft.set(title="TTFT CDF", xlabel="TTFT (s)", ylabel="fraction of requests")
    ax_ttft.set_xscale("log")
    # Plain numbers at 1, 2 and 5 per decade: matplotlib's default labels every minor tick of a short log
    # axis as "2x10^0 3x10^0 ...", and they run into each other.
    ax_ttft.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_ttft.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax_ttft.xaxis.set_minor_formatter(NullFormatter())
    for ax in (ax_usage, ax_hit, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend()
    s0 = results[0][1].summary
    fig.suptitle(f"{s0['workload']} on {s0['model']} / {s0['gpu']}")
    fig.tight_layout()
    return fig


def plot_results(results: list[tuple[str, SimResult]], path: str) -> None:
    """KV usage and cumulative hit rate over time, and the TTFT CDF, one line per variant, as a PNG at ``path``."""
    fig = plot_figure(results)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise InvalidInputError(f"cannot write the plot to {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
