{{/* Names, labels and the image, shared by every template. */}}
{{- define "moeless.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "moeless.policyName" -}}
{{- default .Release.Name .Values.policy.name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "moeless.poolName" -}}
{{- default (printf "%s-pool" .Release.Name) .Values.pool.name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "moeless.labels" -}}
app.kubernetes.io/name: moeless
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: moeless
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "moeless.selector" -}}
app.kubernetes.io/name: moeless
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "moeless.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* KubeRay's RayService when asked, or when "auto" and the cluster serves ray.io/v1; a shared pool's models
are served by plain Deployments (one per model). */}}
{{- define "moeless.kuberay" -}}
{{- $mode := toString .Values.serving.kuberay -}}
{{- if and .Values.pool.enabled (eq $mode "true") -}}{{ fail "pool.enabled serves each model with a plain Deployment: set serving.kuberay to auto or false" }}{{- end -}}
{{- if and (not .Values.pool.enabled) (or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "ray.io/v1/RayService"))) -}}true{{- end -}}
{{- end -}}

{{/* MOELESS_EXPERT_HOSTS of the serving pods: serving.expertHosts, else the policy's pool as its pods in the API
server (serving follows them while it runs; slots: the pool's maxHosts). */}}
{{- define "moeless.expertHosts" -}}
{{- if .Values.serving.expertHosts -}}{{ .Values.serving.expertHosts }}{{- else -}}
{{- $h := .Values.policy.hosts -}}
k8s://{{ .Release.Namespace }}/{{ include "moeless.policyName" . }}:{{ $h.grpcPort | default 50051 }}?slots={{ $h.maxHosts }}{{ if $h.hostNetwork }}&hostNetwork=true{{ end }}
{{- end -}}
{{- end -}}

{{/* "true" when the serving pods mount a model cache (serving.modelCache: a claim or a node directory). */}}
{{- define "moeless.modelCache" -}}
{{- if or .Values.serving.modelCache.persistentVolumeClaim .Values.serving.modelCache.hostPath -}}true{{- end -}}
{{- end -}}

{{/* serving.microBatches and microBatchTokens, checked: `moeless serve`'s flags (a list) or the Ray app's args (a map). */}}
{{- define "moeless.microBatches" -}}
{{- range $key := list "microBatches" "microBatchTokens" -}}
{{- $v := index $.Values.serving $key -}}
{{- if or (not (or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v))) (lt (float64 $v) 1.0) (ne (float64 $v) (floor $v)) -}}{{ fail (printf "serving.%s: %v is not a whole number >= 1" $key $v) }}{{- end -}}
{{- end -}}
{{- $n := int .Values.serving.microBatches -}}{{- $t := int .Values.serving.microBatchTokens -}}
{{- if eq .form "args" -}}micro_batches: {{ $n }}, micro_batch_tokens: {{ $t }}{{- else -}}{{ toJson (list "--micro-batches" (toString $n) "--micro-batch-tokens" (toString $t)) }}{{- end -}}
{{- end -}}

{{/* serving.stepScaler, checked: `moeless serve`'s flags (a list) or the Ray app's args (a map, with its leading ", "); nothing while sloMs is null. */}}
{{- define "moeless.stepScaler" -}}
{{- $s := .Values.serving.stepScaler -}}
{{- if not (kindIs "invalid" $s.sloMs) -}}
{{- if or (not (or (kindIs "float64" $s.sloMs) (kindIs "int64" $s.sloMs) (kindIs "int" $s.sloMs))) (le (float64 $s.sloMs) 0.0) -}}{{ fail (printf "serving.stepScaler.sloMs: %v is not a number of milliseconds > 0" $s.sloMs) }}{{- end -}}
{{- if or (not (or (kindIs "float64" $s.hosts) (kindIs "int64" $s.hosts) (kindIs "int" $s.hosts))) (lt (float64 $s.hosts) 1.0) (ne (float64 $s.hosts) (floor $s.hosts)) -}}{{ fail (printf "serving.stepScaler.hosts: %v is not a whole number >= 1" $s.hosts) }}{{- end -}}
{{- if or (not (or (kindIs "float64" $s.holdSeconds) (kindIs "int64" $s.holdSeconds) (kindIs "int" $s.holdSeconds))) (lt (float64 $s.holdSeconds) 0.0) -}}{{ fail (printf "serving.stepScaler.holdSeconds: %v is not a number of seconds >= 0" $s.holdSeconds) }}{{- end -}}
{{- $admit := $s.admit | default "wait" -}}{{- if not (has $admit (list "wait" "now")) -}}{{ fail (printf "serving.stepScaler.admit: %v is not wait or now" $admit) }}{{- end -}}
{{- $own := list -}}
{{- range $model, $ms := ($s.sloMsByModel | default dict) -}}
{{- if or (not (or (kindIs "float64" $ms) (kindIs "int64" $ms) (kindIs "int" $ms))) (le (float64 $ms) 0.0) -}}{{ fail (printf "serving.stepScaler.sloMsByModel.%s: %v is not a number of milliseconds > 0" $model $ms) }}{{- end -}}
{{- $own = append $own (printf "%s=%v" $model $ms) -}}
{{- end -}}
{{- if eq .form "args" -}}
{{- if $own -}}{{ fail "serving.stepScaler.sloMsByModel: the Ray app (serving.kuberay) serves one model, so a model's own step SLO is sloMs; set it there" }}{{- end -}}
, step_slo_ms: {{ $s.sloMs }}, step_hosts: {{ int $s.hosts }}, step_hold_s: {{ $s.holdSeconds }}, step_admit: {{ $admit }}
{{- else -}}{{ toJson (concat (list "--step-slo-ms" (toString $s.sloMs)) $own (list "--step-hosts" (toString (int $s.hosts)) "--step-hold" (toString $s.holdSeconds) "--step-admit" $admit)) }}{{- end -}}
{{- else if ne .form "args" -}}[]{{- end -}}
{{- end -}}

{{/* serving.transport, checked: how the serving pods' expert calls reach the hosts (`moeless serve --transport`). */}}
{{- define "moeless.transport" -}}
{{- $t := toString .Values.serving.transport -}}
{{- if not (has $t (list "auto" "local" "tcp" "nixl" "grpc")) -}}{{ fail (printf "serving.transport: %q is not one of auto, local, tcp, nixl, grpc" $t) }}{{- end -}}
{{- $t -}}
{{- end -}}

{{/* serving.gpus, checked: nvidia.com/gpu each serving pod (KubeRay: each Ray worker) requests; 0 - CPU only. */}}
{{- define "moeless.servingGpus" -}}
{{- $v := .Values.serving.gpus -}}
{{- if kindIs "invalid" $v -}}{{- $v = 0 -}}{{- end -}}
{{- if or (not (or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v))) (lt (float64 $v) 0.0) (ne (float64 $v) (floor $v)) -}}{{ fail (printf "serving.gpus: %s is not a whole number >= 0 (nvidia.com/gpu each serving pod requests)" (toJson $v)) }}{{- end -}}
{{- int $v -}}
{{- end -}}

{{/* serving.resources with serving.gpus in both requests and limits (an extended resource's request must equal
its limit); a GPU in the user's own resources is replaced. */}}
{{- define "moeless.servingResources" -}}
{{- $r := deepCopy (.Values.serving.resources | default dict) -}}
{{- $g := include "moeless.servingGpus" . | int -}}
{{- if gt $g 0 -}}
{{- range $k := list "requests" "limits" -}}
{{- $_ := set $r $k (merge (dict "nvidia.com/gpu" $g) (index $r $k | default dict)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* "true" when a pod group asks for CUDA IPC (cudaIpc: the node's PID and IPC namespaces), checked: the handles
travel over the local channel, an abstract Unix socket, which only pods on the node's network share. Called with
(dict "where" "serving" "v" .Values.serving). */}}
{{- define "moeless.cudaIpc" -}}
{{- $on := .v.cudaIpc -}}
{{- if not (or (kindIs "invalid" $on) (kindIs "bool" $on)) -}}{{ fail (printf "%s.cudaIpc: %v is not true or false" .where $on) }}{{- end -}}
{{- if and $on (not .v.hostNetwork) -}}{{ fail (printf "%s.cudaIpc needs %s.hostNetwork: CUDA IPC handles travel over the local channel, an abstract Unix socket of the node's network; set %s.hostNetwork=true too" .where .where .where) }}{{- end -}}
{{- if $on -}}true{{- end -}}
{{- end -}}

{{/* `moeless serve`'s --model flags for a list of models, as a JSON array (none for the default model alone). */}}
{{- define "moeless.modelFlags" -}}
{{- $flags := list }}
{{- range . }}{{ $flags = concat $flags (list "--model" .) }}{{ end }}
{{- toJson $flags }}
{{- end }}
