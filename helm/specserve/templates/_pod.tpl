{{/*
The pod template of the server (the Deployment's pods) and, in the multi-node mode, of a
LeaderWorkerSet group: the leader (role "server": tensor-parallel rank 0, the gRPC/HTTP
servers, probes, the rendezvous port) and the workers (role "worker": the other ranks,
no servers, no probes; labelled app.kubernetes.io/component=tp-worker, so the Service,
PDB and the server NetworkPolicy select only leaders).
Call: include "specserve.podTemplate" (dict "root" $ "role" "server" "gpus" N "multiNode" false)
*/}}
{{- define "specserve.podTemplate" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $gpus := int .gpus }}
{{- $multiNode := .multiNode }}
{{- $fullname := include "specserve.fullname" $root }}
{{- with $root -}}
metadata:
  labels:
    {{- $labels := include "specserve.labels" . }}
    {{- if ne $role "server" }}
    {{- $labels = replace "app.kubernetes.io/component: server" "app.kubernetes.io/component: tp-worker" $labels }}
    {{- end }}
    {{- $labels | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") . | sha256sum }}
    {{- if and .Values.metrics.podAnnotations (eq $role "server") }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.server.httpPort | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "specserve.serviceAccountName" . }}
  automountServiceAccountToken: false
  # A Service named "specserve" would inject SPECSERVE_* variables into the server's env.
  enableServiceLinks: false
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ include "specserve.terminationGracePeriodSeconds" . }}
  securityContext:
    runAsNonRoot: true
    {{- with .Values.podSecurityContext }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    seccompProfile:
      type: RuntimeDefault
  {{- $nodeSelector := deepCopy .Values.nodeSelector }}
  {{- if gt $gpus 0 }}
  {{- $nodeSelector = merge $nodeSelector .Values.gpu.nodeSelector }}
  {{- end }}
  {{- with $nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or .Values.tolerations (and (gt $gpus 0) .Values.gpu.tolerate) }}
  tolerations:
    {{- if and (gt $gpus 0) .Values.gpu.tolerate }}
    - key: {{ .Values.gpu.resourceName }}
      operator: Exists
      effect: NoSchedule
    {{- end }}
    {{- with .Values.tolerations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if include "specserve.fetching" . }}
  # Fetches the Hugging Face models the server loads into the model cache before it starts
  # (huggingface_hub's snapshot download; cached ones are not fetched again).
  initContainers:
    - name: fetch-model
      image: {{ include "specserve.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - python
        - -m
        - specserve.hub
        - fetch
        {{- range splitList " " (include "specserve.fetchIds" .) }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: HF_HOME
          value: {{ printf "%s/huggingface" .Values.modelCache.mountPath | quote }}
        - name: HOME
          value: /tmp
        - name: XDG_CACHE_HOME
          value: /tmp/.cache
        - name: HF_HUB_DISABLE_TELEMETRY
          value: "1"
        - name: PYTHONUNBUFFERED
          value: "1"
        {{- with .Values.huggingface.tokenSecret.name }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $root.Values.huggingface.tokenSecret.key }}
        {{- end }}
      resources:
        {{- toYaml .Values.modelCache.fetchResources | nindent 8 }}
      securityContext:
        runAsNonRoot: true
        runAsUser: {{ int .Values.podSecurityContext.runAsUser }}
        runAsGroup: {{ int .Values.podSecurityContext.runAsGroup }}
        allowPrivilegeEscalation: false
        privileged: false
        readOnlyRootFilesystem: true
        capabilities:
          drop:
            - ALL
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: model-cache
          mountPath: {{ .Values.modelCache.mountPath }}
        - name: tmp
          mountPath: /tmp
  {{- end }}
  containers:
    - name: specserve
      image: {{ include "specserve.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - specserve
      args:
        {{- include "specserve.args" . | nindent 8 }}
      {{- if eq $role "server" }}
      ports:
        - name: grpc
          containerPort: {{ int .Values.server.grpcPort }}
          protocol: TCP
        - name: http
          containerPort: {{ int .Values.server.httpPort }}
          protocol: TCP
        {{- if $multiNode }}
        # rank 0 hosts the tensor-parallel rendezvous (LWS_LEADER_ADDRESS:<port>)
        - name: rendezvous
          containerPort: {{ int .Values.parallelism.multiNode.masterPort }}
          protocol: TCP
        {{- end }}
      {{- end }}
      env:
        - name: SPECSERVE_CACHE_DIR
          value: {{ .Values.modelCache.mountPath | quote }}
        # Built-in and chart presets resolve model paths under ${oc.env:SPECSERVE_MODELS_DIR}.
        - name: SPECSERVE_MODELS_DIR
          value: {{ printf "%s/models" .Values.modelCache.mountPath | quote }}
        - name: HF_HOME
          value: {{ printf "%s/huggingface" .Values.modelCache.mountPath | quote }}
        # The server never downloads: models come from the image or the cache (the init
        # container fetches model.hubId there first, unless modelCache.offline).
        - name: HF_HUB_OFFLINE
          value: "1"
        {{- if and .Values.modelCache.offline (include "specserve.fetchIds" .) }}
        # Named in the one-line error when a model.hubId is missing from the cache.
        - name: SPECSERVE_MODEL_FETCH_HINT
          value: "modelCache.offline=true: the chart fetches nothing; set modelCache.offline=false to fetch it in an init container, or fill the cache volume first"
        {{- end }}
        - name: HOME
          value: /tmp
        - name: XDG_CACHE_HOME
          value: /tmp/.cache
        - name: TRITON_CACHE_DIR
          value: {{ ternary (printf "%s/triton" .Values.modelCache.mountPath) "/tmp/triton" (eq .Values.tritonCache.location "modelCache") | quote }}
        - name: PYTHONUNBUFFERED
          value: "1"
        {{- with .Values.apiKey.secret.name }}
        - name: SPECSERVE_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $root.Values.apiKey.secret.key }}
        {{- end }}
        {{- with .Values.apiKey.metricsSecret.name }}
        - name: SPECSERVE_METRICS_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $root.Values.apiKey.metricsSecret.key }}
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        requests:
          {{- with .Values.resources.requests }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- if gt $gpus 0 }}
          {{ .Values.gpu.resourceName }}: {{ $gpus }}
          {{- end }}
        limits:
          {{- with .Values.resources.limits }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- if gt $gpus 0 }}
          {{ .Values.gpu.resourceName }}: {{ $gpus }}
          {{- end }}
      securityContext:
        runAsNonRoot: true
        runAsUser: {{ int .Values.podSecurityContext.runAsUser }}
        runAsGroup: {{ int .Values.podSecurityContext.runAsGroup }}
        allowPrivilegeEscalation: false
        privileged: false
        readOnlyRootFilesystem: true
        capabilities:
          drop:
            - ALL
        seccompProfile:
          type: RuntimeDefault
      {{- if eq $role "server" }}
      # Native gRPC probes (grpc.health.v1); the port must be a number, not a name.
      startupProbe:
        grpc:
          port: {{ int .Values.server.grpcPort }}
          service: ""
        periodSeconds: {{ int .Values.probes.startup.periodSeconds }}
        timeoutSeconds: {{ int .Values.probes.startup.timeoutSeconds }}
        failureThreshold: {{ int .Values.probes.startup.failureThreshold }}
      readinessProbe:
        grpc:
          port: {{ int .Values.server.grpcPort }}
          service: specserve.v1.SpecServe
        periodSeconds: {{ int .Values.probes.readiness.periodSeconds }}
        timeoutSeconds: {{ int .Values.probes.readiness.timeoutSeconds }}
        failureThreshold: {{ int .Values.probes.readiness.failureThreshold }}
      livenessProbe:
        grpc:
          port: {{ int .Values.server.grpcPort }}
          service: ""
        periodSeconds: {{ int .Values.probes.liveness.periodSeconds }}
        timeoutSeconds: {{ int .Values.probes.liveness.timeoutSeconds }}
        failureThreshold: {{ int .Values.probes.liveness.failureThreshold }}
      lifecycle:
        preStop:
          exec:
            command:
              - sleep
              - {{ .Values.lifecycle.preStopSleepSeconds | int | toString | quote }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: {{ .Values.config.dir }}
          readOnly: true
        - name: model-cache
          mountPath: {{ .Values.modelCache.mountPath }}
        - name: dshm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
  volumes:
    - name: config
      configMap:
        name: {{ $fullname }}-config
        items:
          - key: overrides.yaml
            path: overrides.yaml
          {{- with include "specserve.presetItems" . }}
          {{- . | nindent 10 }}
          {{- end }}
    - name: model-cache
      {{- if .Values.modelCache.persistence.enabled }}
      persistentVolumeClaim:
        claimName: {{ .Values.modelCache.persistence.existingClaim | default (printf "%s-model-cache" $fullname) }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ .Values.modelCache.emptyDirSizeLimit }}
      {{- end }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.shm.sizeLimit }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ .Values.tmp.sizeLimit }}
{{- end }}
{{- end }}
