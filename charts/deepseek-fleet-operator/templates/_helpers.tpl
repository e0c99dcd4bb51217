{{/* Chart name, at most 63 characters (a label value). */}}
{{- define "dfo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects: the release name, plus the chart name unless it holds it. */}}
{{- define "dfo.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dfo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dfo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The recommended labels, on every object the chart renders. */}}
{{- define "dfo.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "dfo.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: deepseek-fleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "dfo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dfo.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dfo.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The operator's RBAC rules. files/operator-rbac.yaml is the ClusterRole that `python -m fleet.rbac`
derives from the operator's code, copied in by scripts/sync-chart-crds.sh; a test fails if it drifts.
*/}}
{{- define "dfo.rules" -}}
{{- $role := .Files.Get "files/operator-rbac.yaml" | fromYaml }}
{{- if not $role.rules }}
{{- fail "files/operator-rbac.yaml is missing or has no rules: run scripts/sync-chart-crds.sh" }}
{{- end }}
{{- toYaml $role.rules }}
{{- end }}
