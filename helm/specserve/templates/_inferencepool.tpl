{{/*
Gateway API Inference Extension: an InferencePool (inference.networking.k8s.io/v1, validated
against the extension's release v1.5.0 CRD) over the server pods, and its endpoint picker
(EPP). Names, args, ports, probes, RBAC and the plugins file follow that release's
config/charts/inferencepool chart, so an operator who knows it recognises every object.
*/}}

{{/* Both the pool and the EPP render only when asked for AND the cluster serves the API. */}}
{{- define "specserve.inferencePool" -}}
{{- $caps := .Capabilities.APIVersions }}
{{- if and .Values.inferencePool.enabled (or ($caps.Has "inference.networking.k8s.io/v1/InferencePool") ($caps.Has "inference.networking.k8s.io/v1")) }}true{{ end }}
{{- end }}

{{/* The EPP's name: its Deployment, Service, ServiceAccount, Role and ConfigMap. */}}
{{- define "specserve.eppName" -}}
{{- printf "%s-epp" (include "specserve.fullname" . | trunc 59 | trimSuffix "-") }}
{{- end }}

{{/* The EPP Service the pool points at: the one created here, or an existing one. */}}
{{- define "specserve.eppServiceName" -}}
{{- if .Values.inferencePool.endpointPicker.create }}
{{- include "specserve.eppName" . }}
{{- else }}
{{- required "inferencePool.endpointPicker.serviceName is required when inferencePool.endpointPicker.create is false" .Values.inferencePool.endpointPicker.serviceName }}
{{- end }}
{{- end }}

{{/* EPP pods: their own component, so no server selector (Service, PDB, pool) matches them. */}}
{{- define "specserve.eppSelectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{- define "specserve.eppLabels" -}}
{{ include "specserve.labels" . | replace "app.kubernetes.io/component: server" "app.kubernetes.io/component: endpoint-picker" }}
{{- end }}

{{- define "specserve.eppImage" -}}
{{- $i := .Values.inferencePool.endpointPicker.image }}
{{- if $i.digest }}
{{- printf "%s@%s" $i.repository $i.digest }}
{{- else }}
{{- printf "%s:%s" $i.repository $i.tag }}
{{- end }}
{{- end }}
