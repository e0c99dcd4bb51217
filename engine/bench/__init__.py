"""`deepseek-engine bench`: how close the engine gets to the hardware, side by side with a peer.

| module | what |
|---|---|
| `presets` | named model shapes (random weights) |
| `roofline` | measured ceilings (copy bandwidth, matmul rates) and the bytes / FLOPs each phase must move |
| `timing` | device-synchronized timers |
| `ours` | our engine: prefill, TTFT, CUDA-graph decode, per-layer decode |
| `kernels` | each Triton kernel alone at the preset's shapes |
| `hf_peer` | HF transformers on the same weights, in the same process |
| `report` | results JSON and PNG plot |
| `suite` | runs the above in order and writes the report |
"""
