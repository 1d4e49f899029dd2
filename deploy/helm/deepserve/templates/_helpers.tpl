{{- define "deepserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{ end }}
{{- end }}

{{- define "deepserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "deepserve.labels" -}}
{{ include "deepserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "deepserve.scheme" -}}{{ if .Values.tls.enabled }}HTTPS{{ else }}HTTP{{ end }}{{- end }}

{{/* The server container, shared by the Deployment and the LeaderWorkerSet leader. */}}
{{- define "deepserve.container" -}}
- name: deepserve
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - {{ .Values.model.path | quote }}
    - --config
    - /etc/deepserve/serve.yaml
    {{- if .Values.leaderWorkerSet.enabled }}
    {{- include "deepserve.multinodeArgs" (dict "root" . "nodeRank" "0") | nindent 4 }}
    {{- end }}
    {{- if .Values.model.decryptionKeySecret }}
    - --decryption-key-file
    - /etc/deepserve/decryption/key
    {{- end }}
    {{- range .Values.engine.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    - name: http
      containerPort: {{ .Values.server.port }}
  startupProbe:
    httpGet: {path: /health, port: http, scheme: {{ include "deepserve.scheme" . }}}
    periodSeconds: {{ .Values.probes.startup.periodSeconds }}
    failureThreshold: {{ .Values.probes.startup.failureThreshold }}
  readinessProbe:
    httpGet: {path: /ready, port: http, scheme: {{ include "deepserve.scheme" . }}}
    periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
    failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  livenessProbe:
    httpGet: {path: /health, port: http, scheme: {{ include "deepserve.scheme" . }}}
    periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
    failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  lifecycle:
    preStop:
      # The server drains by itself on SIGTERM; this pause only lets Service endpoints forget the pod first.
      exec: {command: ["sleep", "{{ .Values.server.preStopSleep }}"]}
  resources: {{- toYaml .Values.resources | nindent 4 }}
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: ["ALL"]}
  volumeMounts:
    - {name: config, mountPath: /etc/deepserve/serve.yaml, subPath: serve.yaml, readOnly: true}
    - {name: keys, mountPath: /etc/deepserve/keys, readOnly: true}
    {{- if .Values.tls.enabled }}
    - {name: tls, mountPath: /etc/deepserve/tls, readOnly: true}
    {{- end }}
    - {name: models, mountPath: {{ .Values.model.mountPath }}, readOnly: true}
    {{- if .Values.model.decryptionKeySecret }}
    - {name: decryption-key, mountPath: /etc/deepserve/decryption, readOnly: true}
    {{- end }}
    - {name: tmp, mountPath: /tmp}
    - {name: compile-cache, mountPath: /var/cache/deepserve}
    - {name: dshm, mountPath: /dev/shm}
{{- end }}

{{/* --nnodes/--node-rank/--master-addr/--master-port of one LeaderWorkerSet pod; the LWS controller
     sets LWS_LEADER_ADDRESS and LWS_WORKER_INDEX in every pod of the group. */}}
{{- define "deepserve.multinodeArgs" -}}
- --nnodes
- {{ .root.Values.leaderWorkerSet.size | quote }}
- --node-rank
- {{ .nodeRank | quote }}
- --master-addr
- "$(LWS_LEADER_ADDRESS)"
- --master-port
- {{ .root.Values.leaderWorkerSet.masterPort | quote }}
{{- end }}

{{- define "deepserve.podSpec" -}}
# SIGTERM → drain for --shutdown-timeout; the kubelet must wait for preStop + the drain + a margin.
terminationGracePeriodSeconds: {{ add .Values.server.shutdownTimeout .Values.server.preStopSleep 15 }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
containers:
{{- include "deepserve.container" . | nindent 2 }}
volumes:
  - name: config
    configMap: {name: {{ include "deepserve.fullname" . }}}
  - name: keys
    secret: {secretName: {{ .Values.auth.keysSecret }}}
  {{- if .Values.tls.enabled }}
  - name: tls
    secret: {secretName: {{ .Values.tls.secretName }}}
  {{- end }}
  - name: models
    persistentVolumeClaim: {claimName: {{ .Values.model.pvcName }}, readOnly: true}
  {{- if .Values.model.decryptionKeySecret }}
  - name: decryption-key
    secret: {secretName: {{ .Values.model.decryptionKeySecret }}, defaultMode: 0400}
  {{- end }}
  - name: tmp
    emptyDir: {}
  # Compiled Triton / inductor kernels (DEEPSERVE_CACHE_DIR, set in the image): a claim keeps them for the
  # next pod, the default emptyDir only across container restarts. The root filesystem is read-only.
  - name: compile-cache
    {{- if .Values.compileCache.pvcName }}
    persistentVolumeClaim: {claimName: {{ .Values.compileCache.pvcName }}}
    {{- else }}
    emptyDir: {}
    {{- end }}
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: {{ .Values.shmSize }}}
{{- end }}

{{/* The router's pods: a name of their own, so no selector of the replicas ever matches them. */}}
{{- define "deepserve.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "deepserve.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "deepserve.redisUrl" -}}
{{- if .Values.redis.externalUrl }}{{ .Values.redis.externalUrl }}
{{- else }}redis://{{ include "deepserve.fullname" . }}-redis:6379/0{{ end }}
{{- end }}
