{{/* Names and labels. */}}
{{- define "shortconv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's resource name. KubeRay derives the RayCluster, its pods and services from the
RayService name (adding suffixes), so it is kept to 40 characters to leave room for them.
*/}}
{{- define "shortconv.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "shortconv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shortconv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "shortconv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "shortconv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "shortconv.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Cross-field checks that JSON Schema cannot express; they run before anything renders. */}}
{{- define "shortconv.validate" -}}
{{- $lo := include "shortconv.serveMinReplicas" . | int -}}
{{- $hi := include "shortconv.serveMaxReplicas" . | int -}}
{{- if gt $lo $hi -}}
{{- fail (printf "serve.args: min_replicas (%d) must not exceed max_replicas (%d)" $lo $hi) -}}
{{- end -}}
{{- $min := include "shortconv.workerMinReplicas" . | int -}}
{{- $max := include "shortconv.workerMaxReplicas" . | int -}}
{{- if gt $min $max -}}
{{- fail (printf "workers: minReplicas (%d) must not exceed maxReplicas (%d)" $min $max) -}}
{{- end -}}
{{- with .Values.serve.args.disaggregation -}}
{{- if or (ne $lo (int .decode_replicas)) (ne $hi (int .decode_replicas)) -}}
{{- fail (printf "serve.args: with disaggregation, min_replicas and max_replicas must equal decode_replicas (%d): each role runs a fixed count" (int .decode_replicas)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.apiKey.existingSecret .Values.serve.args.api_key -}}
{{- fail "apiKey.existingSecret: unset serve.args.api_key (the arg would win over the Secret)" -}}
{{- end -}}
{{- end -}}

{{/* GPUs per worker pod: one per TP rank on CUDA, none on CPU. */}}
{{- define "shortconv.gpusPerWorker" -}}
{{- if eq .Values.serve.args.device "cuda" -}}{{ int .Values.serve.args.tp_size }}{{- else -}}0{{- end -}}
{{- end -}}

{{- define "shortconv.workerGroupName" -}}
{{- if .Values.workers.groupName -}}{{ .Values.workers.groupName }}
{{- else if eq .Values.serve.args.device "cuda" -}}gpu-workers
{{- else -}}cpu-workers
{{- end -}}
{{- end -}}

{{/*
Serve's replica bounds: the app args, which values.yaml always sets (a null, like an unset key,
would leave AppArgs' own default to the app while the worker group had no bound to follow).
*/}}
{{- define "shortconv.serveMinReplicas" -}}
{{- required "serve.args.min_replicas is required (the worker group follows it)" .Values.serve.args.min_replicas | int -}}
{{- end -}}

{{- define "shortconv.serveMaxReplicas" -}}
{{- required "serve.args.max_replicas is required (the worker group follows it)" .Values.serve.args.max_replicas | int -}}
{{- end -}}

{{/*
Worker pod bounds default to the Serve replica bounds: one replica per worker pod. NOTE: `kindIs
"invalid"` is how Go templates see a YAML null.
*/}}
{{- define "shortconv.workerMinReplicas" -}}
{{- if kindIs "invalid" .Values.workers.minReplicas -}}
{{- include "shortconv.serveMinReplicas" . -}}
{{- else -}}
{{- int .Values.workers.minReplicas -}}
{{- end -}}
{{- end -}}

{{- define "shortconv.workerMaxReplicas" -}}
{{- if kindIs "invalid" .Values.workers.maxReplicas -}}
{{- include "shortconv.serveMaxReplicas" . -}}
{{- else -}}
{{- int .Values.workers.maxReplicas -}}
{{- end -}}
{{- end -}}

{{/*
serveConfigV2: the same document as deployments/*.yaml, except http_options, which must listen
on all interfaces and on the port the Services target.
*/}}
{{- define "shortconv.serveConfig" -}}
{{- $s := .Values.serve -}}
{{- $app := dict "name" $s.appName "route_prefix" $s.routePrefix "import_path" $s.importPath "args" (include "shortconv.serveArgs" . | fromYaml) -}}
{{- if $s.deployment -}}
{{- $_ := set $app "deployments" (list (merge (dict "name" "LLMServer") $s.deployment)) -}}
{{- end -}}
{{- $http := dict "host" "0.0.0.0" "port" (int .Values.service.port) -}}
{{- $cfg := dict "proxy_location" (default "EveryNode" $s.proxyLocation) "http_options" $http "applications" (list $app) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
serve.args, and in the disaggregated layout each role's Ray custom resource, which only its
worker group offers (shortconv.workerGroups): the app makes the role's replicas ask for it.
*/}}
{{- define "shortconv.serveArgs" -}}
{{- $args := deepCopy .Values.serve.args -}}
{{- with $args.disaggregation -}}
{{- $_ := set . "prefill_resource" (include "shortconv.roleResource" "prefill") -}}
{{- $_ := set . "decode_resource" (include "shortconv.roleResource" "decode") -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/*
Env every Ray container needs. HF_HUB_OFFLINE: weights come from the mounted volume (or the
download init container), never from the Hub at replica start, where a slow or failed fetch
would look like a hung replica.
*/}}
{{- define "shortconv.env" -}}
- name: RAY_SERVE_SESSION_ID_HEADER_KEY
  value: {{ .Values.session.headerKey | quote }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- with .Values.apiKey.existingSecret }}
{{- /* The ingress runs in these pods' Ray workers, which inherit the container's env. */}}
- name: SHORTCONV_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $.Values.apiKey.secretKey | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "shortconv.volumeMounts" -}}
{{- if ne .Values.model.volume.type "none" }}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: {{ .Values.model.volume.readOnly }}
{{- end }}
{{- end -}}

{{- define "shortconv.modelVolume" -}}
{{- $v := .Values.model.volume -}}
{{- if eq $v.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model" (include "shortconv.fullname" .)) $v.pvc.existingClaim }}
{{- else if eq $v.type "hostPath" }}
- name: model
  hostPath:
    path: {{ $v.hostPath.path }}
    {{- with $v.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* Durable sessions: the store directory on every worker pod (replicas run only there), a
claim shared by the pods or, with none named, a directory of the pod's own. */}}
{{- define "shortconv.sessionStoreMount" -}}
{{- with .Values.serve.args.session_store }}
- name: session-store
  mountPath: {{ .path }}
{{- end }}
{{- end -}}

{{- define "shortconv.sessionStoreVolume" -}}
{{- if .Values.serve.args.session_store }}
- name: session-store
  {{- with .Values.sessionStore.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ . }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The checkpoint directory the app will load: `model`, under `model_root` when relative. */}}
{{- define "shortconv.modelDir" -}}
{{- $a := .Values.serve.args -}}
{{- if and $a.model_root (not (hasPrefix "/" $a.model)) -}}
{{- printf "%s/%s" (trimSuffix "/" $a.model_root) $a.model -}}
{{- else -}}
{{- $a.model -}}
{{- end -}}
{{- end -}}

{{/*
Fetches model.download.repoId into the checkpoint directory before Ray starts. Idempotent (skips
when config.json is there), so every pod may run it against a shared volume.
*/}}
{{- define "shortconv.downloadInit" -}}
{{- with .Values.model.download.repoId }}
initContainers:
  - name: download-model
    image: {{ include "shortconv.image" $ }}
    imagePullPolicy: {{ $.Values.image.pullPolicy }}
    command: ["python", "-c"]
    args:
      - |
        import os, sys
        from huggingface_hub import snapshot_download
        dest = sys.argv[1]
        if not os.path.exists(os.path.join(dest, "config.json")):
            snapshot_download(repo_id=sys.argv[2], revision=sys.argv[3], local_dir=dest,
                              allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
      - {{ include "shortconv.modelDir" $ | quote }}
      - {{ . | quote }}
      - {{ $.Values.model.download.revision | quote }}
    {{- with $.Values.model.download.tokenSecretName }}
    env:
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: HF_TOKEN
    {{- end }}
    volumeMounts:
      - name: model
        mountPath: {{ $.Values.model.volume.mountPath }}
{{- end }}
{{- end -}}
