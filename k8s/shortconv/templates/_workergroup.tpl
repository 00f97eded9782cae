{{/*
The worker groups: one (`workers`) in the plain layout; with serve.args.disaggregation, one per
role (docs/disaggregation.md), each `disaggregatedWorkers.<role>` merged over `workers`. A role's
group offers a Ray custom resource of its own (1 per pod), and the app's args name it
(shortconv.serveArgs), so each role's replicas and their TP ranks land only on its pods.
Each group: name, pods (min = max = replicas unless the plain layout's bounds differ), gpus per
pod (one per TP rank of the role), spec (the pod values), role ("" in the plain layout).
*/}}
{{- define "shortconv.workerGroups" -}}
{{- $d := .Values.serve.args.disaggregation -}}
{{- if not $d -}}
{{- $g := dict "name" (include "shortconv.workerGroupName" .) "role" "" "spec" .Values.workers -}}
{{- $_ := set $g "min" (include "shortconv.workerMinReplicas" . | int) -}}
{{- $_ := set $g "max" (include "shortconv.workerMaxReplicas" . | int) -}}
{{- $_ := set $g "gpus" (include "shortconv.gpusPerWorker" . | int) -}}
{{- list $g | toYaml -}}
{{- else -}}
{{- $tp := int .Values.serve.args.tp_size -}}
{{- $prefillTp := int (default $tp $d.prefill_tp_size) -}}
{{- $cuda := eq .Values.serve.args.device "cuda" -}}
{{- $groups := list -}}
{{- range $role := list "prefill" "decode" -}}
{{- $own := index $.Values.disaggregatedWorkers $role -}}
{{- $spec := mergeOverwrite (deepCopy $.Values.workers) (omit $own "groupName" "replicas") -}}
{{- $pods := int (default (index $d (printf "%s_replicas" $role)) $own.replicas) -}}
{{- $gpus := ternary (ternary $prefillTp $tp (eq $role "prefill")) 0 $cuda -}}
{{- $name := default (printf "%s-workers" $role) $own.groupName -}}
{{- $g := dict "name" $name "role" $role "spec" $spec "min" $pods "max" $pods "gpus" $gpus -}}
{{- $groups = append $groups $g -}}
{{- end -}}
{{- $groups | toYaml -}}
{{- end -}}
{{- end -}}

{{/* The Ray custom resource a role's worker pods offer and its replicas ask for. */}}
{{- define "shortconv.roleResource" -}}
{{- printf "shortconv_%s" . -}}
{{- end -}}

{{/* One workerGroupSpecs entry; `.root` the chart's context, `.group` one of shortconv.workerGroups. */}}
{{- define "shortconv.workerGroup" -}}
{{- $r := .root -}}
{{- $g := .group -}}
{{- $w := $g.spec -}}
{{- $gpus := int $g.gpus -}}
- groupName: {{ $g.name }}
  minReplicas: {{ int $g.min }}
  maxReplicas: {{ int $g.max }}
  replicas: {{ int $g.min }}
  {{- with $g.role }}
  # This role's replicas ask for a share of it (serve.args.disaggregation.<role>_resource).
  resources:
    {{ include "shortconv.roleResource" . }}: "1"
  {{- end }}
  rayStartParams:
    metrics-export-port: {{ $r.Values.metrics.port | int | quote }}
    {{- range $k, $v := $w.rayStartParams }}
    {{ $k }}: {{ $v | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "shortconv.selectorLabels" $r | nindent 8 }}
        app.kubernetes.io/component: worker
        {{- with $g.role }}
        shortconv/role: {{ . }}
        {{- end }}
    spec:
      {{- with $r.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "shortconv.downloadInit" $r | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "shortconv.image" $r }}
          imagePullPolicy: {{ $r.Values.image.pullPolicy }}
          env:
            {{- include "shortconv.env" $r | nindent 12 }}
          ports:
            - {name: serve, containerPort: {{ int $r.Values.service.port }}}
            - {name: metrics, containerPort: {{ int $r.Values.metrics.port }}}
          resources:
            {{- $res := deepCopy (default dict $w.resources) }}
            {{- if gt $gpus 0 }}
            {{- /* KubeRay reads num-gpus from the limit; one GPU per TP rank. */}}
            {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $res.limits)) }}
            {{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" $gpus) (default dict $res.requests)) }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            {{- with include "shortconv.volumeMounts" $r | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "shortconv.sessionStoreMount" $r | trim }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            {{- with $w.shmSize }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- with include "shortconv.modelVolume" $r | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "shortconv.sessionStoreVolume" $r | trim }}
        {{- . | nindent 8 }}
        {{- end }}
      {{- with $w.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if or $w.tolerations (gt $gpus 0) }}
      tolerations:
        {{- with $w.tolerations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- if gt $gpus 0 }}
        # GPU nodes are commonly tainted so that only GPU pods land there.
        - key: nvidia.com/gpu
          operator: Exists
          effect: NoSchedule
        {{- end }}
      {{- end }}
      {{- with $w.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
