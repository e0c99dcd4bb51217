"""The deepseek-fleet operator: DeepSeekDeployment resources reconciled into GPU fleets.

Module map: `spec`/`status` are the API (pydantic, mirrored by the CRD that `crd` renders),
`manifests` holds the pure builders of every child, `reconcile` drives one level-based pass,
`kube` talks to the API server, `handlers` wires it all into Kopf and `cli` runs it.
"""
