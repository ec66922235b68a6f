{{/*
Chart name: .Chart.Name or nameOverride, at most 63 characters (a label value).
*/}}
{{- define "expertmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name "<release>-<name>" (just the release name when it already contains the chart name), or
fullnameOverride; truncated at 63 characters (a DNS label) with any trailing "-" trimmed.
*/}}
{{- define "expertmesh.fullname" -}}
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

{{/*
"<base>-<suffix>" within 63 characters: the base is cut (and a trailing "-" trimmed) so the suffix survives.
Usage: include "expertmesh.suffixed" (list $base "suffix")
*/}}
{{- define "expertmesh.suffixed" -}}
{{- $base := index . 0 }}
{{- $suffix := index . 1 }}
{{- printf "%s-%s" ($base | trunc (sub 62 (len $suffix) | int) | trimSuffix "-") $suffix }}
{{- end }}

{{/*
Name of cluster-scoped objects (ClusterRole, ClusterRoleBinding): prefixed with the release namespace so two
releases of the same name in different namespaces do not collide.
Usage: include "expertmesh.clusterName" (list . "suffix")   (suffix "" for none)
*/}}
{{- define "expertmesh.clusterName" -}}
{{- $ctx := index . 0 }}
{{- $suffix := index . 1 }}
{{- $base := printf "%s-%s" $ctx.Release.Namespace (include "expertmesh.fullname" $ctx) }}
{{- if $suffix }}
{{- include "expertmesh.suffixed" (list $base $suffix) }}
{{- else }}
{{- $base | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
helm.sh/chart label value: "<chart>-<version>".
*/}}
{{- define "expertmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels (stable across upgrades: never add the version here).
Usage: include "expertmesh.selectorLabels" (dict "ctx" . "component" "operator")
*/}}
{{- define "expertmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "expertmesh.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Common labels of every object the chart renders.
Usage: include "expertmesh.labels" (dict "ctx" . "component" "operator")
*/}}
{{- define "expertmesh.labels" -}}
helm.sh/chart: {{ include "expertmesh.chart" .ctx }}
{{ include "expertmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: expertmesh
{{- end }}

{{/*
The operator's ServiceAccount name.
*/}}
{{- define "expertmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "expertmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: set the name of an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference: repository:tag, the tag defaulting to the chart's appVersion.
*/}}
{{- define "expertmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
"true" in namespace-scoped mode (rbac.namespaced or operator.watchNamespace set), else "".
*/}}
{{- define "expertmesh.namespaced" -}}
{{- if or .Values.rbac.namespaced .Values.operator.watchNamespace }}true{{ end }}
{{- end }}

{{/*
The namespace the operator watches in namespace-scoped mode (and where the example goes in that mode).
*/}}
{{- define "expertmesh.watchNamespace" -}}
{{- default .Release.Namespace .Values.operator.watchNamespace }}
{{- end }}

{{/*
Namespace of the example MoEDeployment: the watched one in namespace-scoped mode, else the release's.
*/}}
{{- define "expertmesh.exampleNamespace" -}}
{{- if include "expertmesh.namespaced" . }}{{ include "expertmesh.watchNamespace" . }}{{ else }}{{ .Release.Namespace }}{{ end }}
{{- end }}

{{/*
Name of the example MoEDeployment (at most 40 characters: the operator appends "-attention", "-expert-<n>").
*/}}
{{- define "expertmesh.exampleName" -}}
{{- if .Values.example.name }}
{{- .Values.example.name }}
{{- else }}
{{- printf "%s-example" (include "expertmesh.fullname" . | trunc 32 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/*
Hardened container securityContext (restricted Pod Security Standard).
*/}}
{{- define "expertmesh.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Hardened pod securityContext.
*/}}
{{- define "expertmesh.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
"true" when the operator runs as several replicas electing a leader through Kopf peering (operator.replicas > 1).
*/}}
{{- define "expertmesh.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{ end }}
{{- end }}

{{/*
An example pool's `autoscale` (spec.*Workers.autoscale) from its values ({enabled, minReplicas, maxReplicas, metric,
target}); nothing when not enabled.
*/}}
{{- define "expertmesh.exampleAutoscale" -}}
{{- if .enabled }}
autoscale:
  minReplicas: {{ .minReplicas }}
  maxReplicas: {{ .maxReplicas }}
  metric: {{ .metric }}
  target: {{ .target }}
{{- end }}
{{- end }}
