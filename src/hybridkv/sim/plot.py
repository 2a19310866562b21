"""Plots of simulation results (needs the ``sim`` extra: matplotlib)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.sim.simulator import SimResult


def require_matplotlib() -> None:
    """Raise ``InvalidInputError`` naming the extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise InvalidInputError("--plot needs matplotlib: pip install 'hybridkv[sim]'") from exc


def plot_results(results: list[tuple[str, SimResult]], path: str) -> None:
    """KV usage and cumulative hit rate over time, and the TTFT CDF, one line per variant, as a PNG at ``path``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    for ax in (ax_usage, ax_hit, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend()
    s0 = results[0][1].summary
    fig.suptitle(f"{s0['workload']} on {s0['model']} / {s0['gpu']}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise InvalidInputError(f"cannot write the plot to {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
