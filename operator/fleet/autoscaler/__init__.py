"""Queue-depth autoscaling of a fleet's engine Deployment, built into the operator.

Module map: `policy` (a fleet's settings as the decision uses them), `decision` (the HPA-style
recommendation with tolerance, stabilization windows and step bounds; pure), `pods` (which engine
pods count and where their metrics are), `metrics_client` (reads and parses every engine's
/metrics at once), `deletion_cost` (which pods a scale-down removes), `report` (status fields,
the ScalingReady condition and Event texts), `fleet_scaler` (one fleet's poll loop) and
`registry` (one asyncio task per autoscaled fleet).
"""
