{{/* Names, labels and shared fragments of every rlfleet object. */}}

{{- define "rlfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>"; call with (list $ "router"). */}}
{{- define "rlfleet.name" -}}
{{- printf "%s-%s" (include "rlfleet.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{- define "rlfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ (index . 0).Chart.Name }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "rlfleet.labels" -}}
{{ include "rlfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
helm.sh/chart: {{ printf "%s-%s" (index . 0).Chart.Name (index . 0).Chart.Version }}
{{- end -}}

{{/* An rlfleet image: (list $ "router") -> <image.registry>/router:<image.tag> (docker.io/rlfleet/router:0.1.0) */}}
{{- define "rlfleet.image" -}}
{{- $ := index . 0 -}}
{{- printf "%s/%s:%s" $.Values.image.registry (index . 1) (default $.Chart.AppVersion $.Values.image.tag) -}}
{{- end -}}

{{- define "rlfleet.redisUrl" -}}
{{- if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else -}}
{{- printf "redis://%s:6379/0" (include "rlfleet.name" (list . "redis")) -}}
{{- end -}}
{{- end -}}

{{- define "rlfleet.routerUrl" -}}
{{- printf "http://%s:%d" (include "rlfleet.name" (list . "router")) (int .Values.router.port) -}}
{{- end -}}

{{/* Engine i's URL through the engines' headless Service (stable pod names of the StatefulSet). */}}
{{- define "rlfleet.engineUrls" -}}
{{- $name := include "rlfleet.name" (list . "engine") -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.engine.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc:%d" $name $i $name $.Release.Namespace (int $.Values.engine.port)) -}}
{{- end -}}
{{- toJson $urls -}}
{{- end -}}

{{- define "rlfleet.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "rlfleet.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}

{{/* "true" when the trainer broadcasts weights to the engines over a process group they join (trainer.env
RLFLEET_TRAINER_WEIGHT_SYNC=distributed), else empty. */}}
{{- define "rlfleet.distributedWeightSync" -}}
{{- if eq (toString (get (.Values.trainer.env | default dict) "RLFLEET_TRAINER_WEIGHT_SYNC")) "distributed" }}true{{ end -}}
{{- end -}}

{{/* The shared volume: models, and the weight versions the trainer writes and engines load by path. */}}
{{- define "rlfleet.dataVolume" -}}
- name: data
  persistentVolumeClaim:
    claimName: {{ default (include "rlfleet.name" (list . "data")) .Values.data.existingClaim }}
{{- end -}}

{{/* An HTTP probe; call with (dict "port" 8000 "probe" .Values.x.probes.liveness), and "path" "/liveness" for a
service whose liveness must not hang on its dependencies. The probe's own `path` value wins; /health by default. */}}
{{- define "rlfleet.httpProbe" -}}
httpGet:
  path: {{ .probe.path | default .path | default "/health" }}
  port: {{ .port }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/* The API token (Runs API, router admin endpoints): one Secret, mounted read-only where each service reads it. */}}
{{- define "rlfleet.apiTokenFile" -}}
/var/run/secrets/rlfleet/api_token
{{- end -}}

{{- define "rlfleet.apiTokenMount" -}}
- name: api-token
  mountPath: /var/run/secrets/rlfleet
  readOnly: true
{{- end -}}

{{- define "rlfleet.apiTokenVolume" -}}
- name: api-token
  secret:
    secretName: {{ default (include "rlfleet.name" (list . "api-token")) .Values.apiToken.existingSecret }}
    defaultMode: 0440
    items:
      - key: token
        path: api_token
{{- end -}}

{{/* A container's env: the entries the chart sets (`chart`: a YAML list, rendered by the component's
"rlfleet.<component>.env"), less those whose names the component's `env` value sets, then that value's entries. So a
component's env overrides the chart's variables, and each name appears once (server-side apply refuses a repeated
name; Helm 3's upgrade patches mishandle one). Call with (dict "chart" (include "rlfleet.router.env" .) "env"
.Values.router.env). */}}
{{- define "rlfleet.env" -}}
{{- $user := .env | default dict -}}
{{- $entries := list -}}
{{- range fromYamlArray .chart -}}
{{- if not (hasKey $user .name) -}}
{{- $entries = append $entries . -}}
{{- end -}}
{{- end -}}
{{- range $name, $value := $user -}}
{{- /* Strings, as Kubernetes wants them (8 -> "8", true -> "true"); a null is empty; a list or a mapping is JSON,
as the services read list and mapping variables (toString wrote [a b]). */ -}}
{{- $text := ternary (toJson $value) (toString $value) (or (kindIs "slice" $value) (kindIs "map" $value)) -}}
{{- $entries = append $entries (dict "name" $name "value" (ternary "" $text (kindIs "invalid" $value))) -}}
{{- end -}}
{{- with $entries }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* A Kubernetes CPU quantity (2, "1.5", 500m) in millicores, rounded down. */}}
{{- define "rlfleet.millicores" -}}
{{- $quantity := toString . -}}
{{- if hasSuffix "m" $quantity -}}
{{- float64 (trimSuffix "m" $quantity) | floor | int -}}
{{- else -}}
{{- mulf (float64 $quantity) 1000.0 | floor | int -}}
{{- end -}}
{{- end -}}

{{/* Intra-op torch threads of each of `ranks` processes sharing a container's CPU request (`cpu`): one per whole
requested CPU, at least one, so that the ranks do not fight over the cores the pod was scheduled with. Empty without
a CPU request (the service's own default then). Call with (dict "cpu" .Values.x.resources.requests.cpu "ranks" 1). */}}
{{- define "rlfleet.torchThreads" -}}
{{- if .cpu -}}
{{- max 1 (div (include "rlfleet.millicores" .cpu | int) (mul 1000 (max 1 (int .ranks)))) -}}
{{- end -}}
{{- end -}}

{{/* The backend of the distributed weight sync's group: trainer.env's RLFLEET_TRAINER_WEIGHT_SYNC_BACKEND, else nccl
between SGLang engines and a GPU trainer (as rlfleet.trainer.env sets it), else the trainer's default, gloo. */}}
{{- define "rlfleet.weightSyncBackend" -}}
{{- $given := get (.Values.trainer.env | default dict) "RLFLEET_TRAINER_WEIGHT_SYNC_BACKEND" | toString -}}
{{- if and $given (ne $given "<nil>") -}}
{{- $given -}}
{{- else if and (eq .Values.engine.backend "sglang") (gt (int .Values.trainer.gpusPerNode) 0) -}}
nccl
{{- else -}}
gloo
{{- end -}}
{{- end -}}
