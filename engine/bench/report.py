"""Results JSON and a PNG plot (ours against the peer and the floors)."""

import json
from pathlib import Path


def write_json(result: dict, out_dir: Path, name: str | None = None) -> Path:
    """<out_dir>/<name or the preset>.json"""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name or result['preset']}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return path


def write_plot(result: dict, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (["decode", "prefill"] + (["long_context_decode"] if result.get("long_context_decode") else [])
              + (["layers"] if isinstance(result.get("layers"), list) and result["layers"] else []))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2))
    hf = result.get("hf") or {}
    for ax, panel in zip(axes, panels):
        if panel == "layers":
            layers = result["layers"]
            xs = [str(layer["layer"]) for layer in layers]
            ax.bar(xs, [layer["seconds"] * 1e6 for layer in layers], label="measured")
            ax.plot(xs, [layer["bandwidth_floor_s"] * 1e6 for layer in layers], "k_", markersize=30, mew=2,
                    label="bandwidth floor")
            ax.set(xlabel="decoder layer (batch 1)", ylabel="µs per step", title="decode, per layer")
            ax.legend(loc="lower right")
            continue
        key, floor_key = (("prefill_tok_s", "compute_floor_s") if panel == "prefill"
                          else (f"{panel}_tok_s", "bandwidth_floor_s"))
        xs = list(result[key])
        ours = [result[key][x] for x in xs]
        ax.plot(xs, ours, "o-", label="ours")
        if hf.get(key):
            ax.plot(xs, [hf[key].get(x) for x in xs], "s--", label="HF transformers")
        phase = result[panel]
        # tokens per step (sequences, prompt tokens, or one stream's token) over the step's floor
        per_step = (lambda x: 1) if panel == "long_context_decode" else int
        floors = [per_step(x) / phase[x][floor_key] if phase[x].get(floor_key) else None for x in xs]
        ax.plot(xs, floors, "k:", label="matmul floor" if panel == "prefill" else "bandwidth floor")
        ax.set_yscale("log")
        xlabel = {"decode": "concurrent sequences", "prefill": "prompt tokens",
                  "long_context_decode": "context tokens (one stream)"}[panel]
        title = "decode, one stream" if panel == "long_context_decode" else panel
        ax.set(xlabel=xlabel, ylabel="tokens/s", title=f"{title} ({result['preset']}, {result['gpu']})")
        ax.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['preset']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
