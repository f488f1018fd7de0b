{{- define "kvsparse.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvsparse.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "kvsparse.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvsparse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvsparse.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvsparse.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvsparse.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "kvsparse.servedModelName" -}}
{{ .Values.model.servedModelName | default .Values.model.hfRepo | default .Values.model.path }}
{{- end }}

{{/* The Secret holding the OpenAI API key: the one named, else the one the chart generates
(templates/api-key-secret.yaml), else none (generate: false, an endpoint without a key). */}}
{{- define "kvsparse.apiKeySecretName" -}}
{{- if .Values.serve.apiKeySecret.name }}
{{- .Values.serve.apiKeySecret.name }}
{{- else if .Values.serve.apiKeySecret.generate }}
{{- include "kvsparse.fullname" . }}-api-key
{{- end }}
{{- end }}

{{/* The Serve application's arguments: service.ray_app.RayAppConfig fields. */}}
{{- define "kvsparse.serveArgs" -}}
{{- $engine := merge (dict "tensor_parallel_size" (int .Values.tensorParallelSize)) (deepCopy .Values.engine) -}}
{{- $min := int .Values.replicas -}}
{{- $max := int .Values.replicas -}}
{{- if .Values.autoscaling.enabled }}
{{- $min = int .Values.autoscaling.minReplicas -}}
{{- $max = int .Values.autoscaling.maxReplicas -}}
{{- end }}
{{- $args := dict "model" .Values.model.path "engine" $engine "sparsity" (deepCopy .Values.sparsity) "served_model_name" (include "kvsparse.servedModelName" .) "min_replicas" $min "max_replicas" $max "target_ongoing_requests" .Values.autoscaling.targetOngoingRequests "max_queued_requests" (int .Values.serve.maxQueuedRequests) "num_cpus_per_replica" .Values.serve.numCpusPerReplica "ingress_replicas" (int .Values.serve.ingressReplicas) -}}
{{- if .Values.autoscaling.enabled }}
{{- $_ := set $args "autoscaling_config" (deepCopy .Values.autoscaling.config) -}}
{{- end }}
{{- if .Values.pools }}
{{- $_ := set $args "pools" .Values.pools -}}
{{- end }}
{{- if ne .Values.engineKind "native" }}
{{- $_ := set $args "engine_kind" .Values.engineKind -}}
{{- end }}
{{- $_ := set $args "stream_interval" (int .Values.serve.streamInterval) -}}
{{- with .Values.serve.requestRouterClass }}
{{- $_ := set $args "request_router_class" . -}}
{{- end }}
{{- if ge (float64 .Values.serve.gracefulShutdownTimeoutS) (float64 .Values.terminationGracePeriodSeconds) }}
{{- fail "serve.gracefulShutdownTimeoutS must be below terminationGracePeriodSeconds: a replica draining its requests would be killed first" }}
{{- end }}
{{- $ingressDrain := float64 (include "kvsparse.ingressDrainS" .) }}
{{- if ge $ingressDrain (float64 .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "terminationGracePeriodSeconds must be above %g: with direct ingress (serve.rayServeEnv: throughput-optimized or HAProxy mode) Ray Serve keeps a stopping ingress replica for its minimum drain period + 5 s, and the pod would be killed first" $ingressDrain) }}
{{- end }}
{{- $_ := set $args "graceful_shutdown_timeout_s" .Values.serve.gracefulShutdownTimeoutS -}}
{{- if not (kindIs "invalid" .Values.serve.maxInflightRequests) }}
{{- $_ := set $args "max_inflight_requests" (int .Values.serve.maxInflightRequests) -}}
{{- end }}
{{- if not (kindIs "invalid" .Values.serve.maxOngoingRequests) }}
{{- $_ := set $args "max_ongoing_requests" (int .Values.serve.maxOngoingRequests) -}}
{{- end }}
{{- toYaml (merge (deepCopy .Values.serve.extraArgs) $args) }}
{{- end }}

{{/* Environment of every Ray container. */}}
{{- define "kvsparse.env" -}}
- name: HF_HOME
  value: {{ .Values.model.cache.mountPath | quote }}
{{- if include "kvsparse.calibrates" . }}
- name: KVSPARSE_PROFILE_DIR
  value: {{ include "kvsparse.profileDir" . | quote }}
{{- end }}
{{- if .Values.model.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hfTokenSecret.name }}
      key: {{ .Values.model.hfTokenSecret.key }}
{{- end }}
{{- with include "kvsparse.apiKeySecretName" . }}
- name: KVSPARSE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.serve.apiKeySecret.key }}
{{- end }}
{{- range $k, $v := .Values.serve.rayServeEnv }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- range $k, $v := .Values.ncclEnv }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Whether GPU pods calibrate the model: it needs the model cache, where the profile goes. */}}
{{- define "kvsparse.calibrates" -}}
{{- if and .Values.calibration.enabled .Values.model.cache.enabled }}true{{ end }}
{{- end }}

{{/* Where the calibration step writes, and the engines read, the served model's profile. */}}
{{- define "kvsparse.profileDir" -}}
{{- printf "%s/kvsparse-profiles" (trimSuffix "/" .Values.model.cache.mountPath) }}
{{- end }}

{{/*
Before Ray starts on a GPU pod: the model download into the cache volume, then the layer
calibration of the model (once per cache: it skips a model that has a profile there).
*/}}
{{- define "kvsparse.initContainers" -}}
{{- if .Values.model.hfRepo }}
{{- if not .Values.model.cache.enabled }}
{{- fail "model.hfRepo downloads into the model cache: set model.cache.enabled=true (or model.hfRepo=\"\")" }}
{{- end }}
- name: download-model
  image: {{ include "kvsparse.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - |
      import json, os
      from huggingface_hub import snapshot_download
      snapshot_download(os.environ["MODEL_REPO"], revision=os.environ["MODEL_REVISION"],
                        local_dir=os.environ["MODEL_PATH"],
                        allow_patterns=json.loads(os.environ["MODEL_PATTERNS"]))
  env:
    - name: MODEL_REPO
      value: {{ .Values.model.hfRepo | quote }}
    - name: MODEL_REVISION
      value: {{ .Values.model.revision | quote }}
    - name: MODEL_PATH
      value: {{ .Values.model.path | quote }}
    - name: MODEL_PATTERNS
      value: {{ toJson .Values.model.downloadPatterns | quote }}
    {{- include "kvsparse.env" . | nindent 4 }}
  volumeMounts:
    {{- include "kvsparse.volumeMounts" . | nindent 4 }}
{{- end }}
{{- if include "kvsparse.calibrates" . }}
- name: calibrate-layers
  image: {{ include "kvsparse.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  # A failed calibration (a model that needs tensor parallelism does not fit one GPU) leaves
  # the pod to start with the first 3 layers whole, as the engines then log.
  command:
    - sh
    - -c
    - 'kvsparse calibrate "$@" || echo "kvsparse calibrate failed: the engines keep the first 3 layers whole" >&2'
    - kvsparse-calibrate
  args:
    - --model={{ .Values.model.path }}
    - --skip-existing
    - --compare-ratios=
    - --device={{ .Values.engine.device | default "cuda" }}
    - --dtype={{ .Values.engine.dtype | default "bfloat16" }}
    {{- with .Values.engine.quantization }}
    - --quantization={{ . }}
    {{- end }}
    {{- with .Values.engine.kv_cache_dtype }}
    - --kv-cache-dtype={{ . }}
    {{- end }}
    {{- range .Values.calibration.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "kvsparse.env" . | nindent 4 }}
  resources:
    limits:
      nvidia.com/gpu: {{ .Values.tensorParallelSize | quote }}
  volumeMounts:
    {{- include "kvsparse.volumeMounts" . | nindent 4 }}
{{- end }}
{{- end }}

{{- define "kvsparse.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- if .Values.model.cache.enabled }}
- name: model-cache
{{- if .Values.model.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.cache.emptyDirSizeLimit }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvsparse.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if .Values.model.cache.enabled }}
- name: model-cache
  mountPath: {{ .Values.model.cache.mountPath }}
{{- end }}
{{- end }}

{{/*
Seconds Ray Serve keeps a stopping ingress replica: serve.gracefulShutdownTimeoutS, raised in
direct ingress mode (on with throughput-optimized or HAProxy mode unless switched off) to
RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (30 unless set) + 5, the time load balancers get
to stop sending to it.
*/}}
{{- define "kvsparse.ingressDrainS" -}}
{{- $env := .Values.serve.rayServeEnv | default dict -}}
{{- $direct := eq (toString (get $env "RAY_SERVE_THROUGHPUT_OPTIMIZED")) "1" -}}
{{- if hasKey $env "RAY_SERVE_ENABLE_DIRECT_INGRESS" -}}
{{- $direct = eq (toString (get $env "RAY_SERVE_ENABLE_DIRECT_INGRESS")) "1" -}}
{{- end -}}
{{- if eq (toString (get $env "RAY_SERVE_ENABLE_HA_PROXY")) "1" -}}
{{- $direct = true -}}
{{- end -}}
{{- $drain := float64 .Values.serve.gracefulShutdownTimeoutS -}}
{{- if $direct -}}
{{- $minDrain := 30.0 -}}
{{- if hasKey $env "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" -}}
{{- $minDrain = float64 (get $env "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S") -}}
{{- end -}}
{{- $drain = maxf $drain (addf $minDrain 5) -}}
{{- end -}}
{{- $drain -}}
{{- end }}

{{/* Every metric series the application exports, by the name a standalone server gives it
(service.metrics.RAY_NAMES; tests/deploy keeps the two equal). */}}
{{- define "kvsparse.metricSeries" -}}
[
  "vllm:time_to_first_token_seconds_bucket",
  "vllm:time_to_first_token_seconds_sum",
  "vllm:time_to_first_token_seconds_count",
  "vllm:inter_token_latency_seconds_bucket",
  "vllm:inter_token_latency_seconds_sum",
  "vllm:inter_token_latency_seconds_count",
  "vllm:request_time_per_output_token_seconds_bucket",
  "vllm:request_time_per_output_token_seconds_sum",
  "vllm:request_time_per_output_token_seconds_count",
  "vllm:e2e_request_latency_seconds_bucket",
  "vllm:e2e_request_latency_seconds_sum",
  "vllm:e2e_request_latency_seconds_count",
  "vllm:prompt_tokens_total",
  "vllm:generation_tokens_total",
  "vllm:num_requests_running",
  "vllm:num_requests_waiting",
  "vllm:kv_cache_usage_perc",
  "vllm:num_preemptions_total",
  "vllm:request_success_total",
  "vllm:prefix_cache_queries_total",
  "vllm:prefix_cache_hits_total",
  "kvsparse_request_errors_total",
  "kvsparse_kv_blocks_used",
  "kvsparse_kv_blocks_free",
  "kvsparse_compression_ratio_bucket",
  "kvsparse_compression_ratio_sum",
  "kvsparse_compression_ratio_count",
  "kvsparse_layer_plan_info",
  "kvsparse_gpu_memory_peak_bytes"
]
{{- end }}
