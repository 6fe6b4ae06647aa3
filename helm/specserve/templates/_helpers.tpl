{{/* vim: set filetype=mustache: */}}

{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specserve.fullname" -}}
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

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of the server pods (the test pod has another component). */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Label that admits a client pod through the NetworkPolicy. */}}
{{- define "specserve.clientLabel" -}}
{{- printf "%s-client" (include "specserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* GPUs per pod: the tensor-parallel size; 0 = CPU mode. */}}
{{- define "specserve.gpus" -}}
{{- int .Values.parallelism.tensorParallelSize }}
{{- end }}

{{/*
Multi-node tensor parallelism: a LeaderWorkerSet instead of the Deployment, only when it is
asked for (parallelism.multiNode.enabled, GPU mode) AND the cluster serves its API.
*/}}
{{- define "specserve.multiNode" -}}
{{- $caps := .Capabilities.APIVersions }}
{{- if and .Values.parallelism.multiNode.enabled (gt (int .Values.parallelism.tensorParallelSize) 0) (or ($caps.Has "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet") ($caps.Has "leaderworkerset.x-k8s.io/v1")) }}true{{ end }}
{{- end }}

{{/* GPUs per pod of a LeaderWorkerSet group: tensorParallelSize / nodes. */}}
{{- define "specserve.gpusPerNode" -}}
{{- div (int .Values.parallelism.tensorParallelSize) (int .Values.parallelism.multiNode.nodes) }}
{{- end }}

{{/* Every pod of the release, leaders and tensor-parallel workers alike. */}}
{{- define "specserve.groupSelectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* What the HPA / ScaledObject scale: the Deployment, or the LeaderWorkerSet (its groups). */}}
{{- define "specserve.scaleTargetRef" -}}
{{- if include "specserve.multiNode" . -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else -}}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "specserve.fullname" . }}
{{- end }}

{{- define "specserve.device" -}}
{{- if gt (int .Values.parallelism.tensorParallelSize) 0 }}cuda{{ else }}cpu{{ end }}
{{- end }}

{{/* The server image: image.repository is required (no image is published for you). */}}
{{- define "specserve.image" -}}
{{- $repo := required "image.repository is required: set it to the specserve image you built (docker/Dockerfile.cpu or docker/Dockerfile.cuda) and pushed or loaded into your cluster, e.g. --set image.repository=specserve for a local build loaded into kind; see docs/deploy.md" .Values.image.repository }}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion (include "specserve.device" .)) }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repo .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}
{{- end }}

{{/* model.hubId with its revision: org/name[@revision]; empty without a hubId. */}}
{{- define "specserve.hubModel" -}}
{{- with .Values.model.hubId }}{{ . }}{{ with $.Values.model.revision }}@{{ . }}{{ end }}{{ end }}
{{- end }}

{{/*
The Hugging Face ids the init container fetches into the model cache, space-separated:
model.hubId[@revision], and method.model when it is a Hugging Face id (org/name[@rev]).
*/}}
{{- define "specserve.fetchIds" -}}
{{- $ids := list }}
{{- with include "specserve.hubModel" . }}{{ $ids = append $ids . }}{{ end }}
{{- with .Values.method.model }}
{{- if regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$" . }}{{ $ids = append $ids . }}{{ end }}
{{- end }}
{{- join " " $ids }}
{{- end }}

{{/* "true" when an init container fetches models (ids to fetch and modelCache.offline false). */}}
{{- define "specserve.fetching" -}}
{{- if and (include "specserve.fetchIds" .) (not .Values.modelCache.offline) }}true{{ end }}
{{- end }}

{{/*
The Hydra overrides passed to `specserve`, one per line, in a stable order:
model, method, K, draft, parallelism, device, server, then config.extraOverrides.
*/}}
{{- define "specserve.overrides" -}}
{{- $v := .Values }}
{{- $tp := int $v.parallelism.tensorParallelSize }}
model={{ $v.model.name }}
{{ with include "specserve.hubModel" . }}model.path={{ if contains "@" . }}'{{ . }}'{{ else }}{{ . }}{{ end }}
model.name={{ $v.model.hubId }}
{{ end -}}
{{ with $v.model.dtype }}model.dtype={{ . }}
{{ end }}
{{- with $v.method.name }}+method={{ . }}
method.num_speculative_tokens={{ int $v.method.numSpeculativeTokens }}
{{ with $v.method.model }}method.model={{ if contains "@" . }}'{{ . }}'{{ else }}{{ . }}{{ end }}
{{ end }}
{{- end }}
{{- with $v.draft.name }}draft={{ . }}
{{ end -}}
parallelism.tensor_parallel_size={{ max $tp 1 }}
engine.device={{ include "specserve.device" . }}
server.grpc_port={{ int $v.server.grpcPort }}
server.http_port={{ int $v.server.httpPort }}
server.drain_timeout_s={{ int $v.server.drainTimeoutSeconds }}
{{ if include "specserve.multiNode" . }}parallelism.master_port={{ int $v.parallelism.multiNode.masterPort }}
{{ end -}}
{{ range $v.config.extraOverrides }}{{ . }}
{{ end }}
{{- end }}

{{/* Full container args: --config-dir, optional --config-name, overrides. */}}
{{- define "specserve.args" -}}
- --config-dir
- {{ .Values.config.dir | quote }}
{{- with .Values.config.name }}
- --config-name
- {{ . | quote }}
{{- end }}
{{- range (include "specserve.overrides" . | trim | splitList "\n") }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* ConfigMap key <-> file path for group presets (keys cannot hold "/"). */}}
{{- define "specserve.presetItems" -}}
{{- range $group := list "model" "draft" }}
{{- range $name, $_ := index $.Values.config.presets $group }}
- key: {{ printf "%s--%s.yaml" $group $name }}
  path: {{ printf "%s/%s.yaml" $group $name }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add (int .Values.lifecycle.preStopSleepSeconds) (int .Values.server.drainTimeoutSeconds) 15 }}
{{- else }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* KEDA is used only when asked for AND the cluster serves its API; otherwise the HPA. */}}
{{- define "specserve.useKeda" -}}
{{- if and .Values.autoscaling.enabled .Values.autoscaling.keda.enabled (.Capabilities.APIVersions.Has "keda.sh/v1alpha1/ScaledObject") }}true{{ end }}
{{- end }}

{{/* Cross-field checks the JSON schema cannot express. */}}
{{- define "specserve.validate" -}}
{{- $p := .Values.parallelism }}
{{- if $p.multiNode.enabled }}
{{- if eq (int $p.tensorParallelSize) 0 }}
{{- fail "parallelism.multiNode.enabled needs GPUs: set parallelism.tensorParallelSize" }}
{{- end }}
{{- if mod (int $p.tensorParallelSize) (int $p.multiNode.nodes) }}
{{- fail (printf "parallelism.tensorParallelSize (%d) must be a multiple of parallelism.multiNode.nodes (%d)" (int $p.tensorParallelSize) (int $p.multiNode.nodes)) }}
{{- end }}
{{- end }}
{{- if lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas) }}
{{- fail "autoscaling.maxReplicas must be >= autoscaling.minReplicas" }}
{{- end }}
{{- if and .Values.modelCache.persistence.enabled (not .Values.modelCache.persistence.existingClaim) (not .Values.modelCache.persistence.size) }}
{{- fail "modelCache.persistence.size is required when the chart creates the PVC" }}
{{- end }}
{{- end }}
