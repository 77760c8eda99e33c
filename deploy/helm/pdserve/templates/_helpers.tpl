{{/*
Names, labels and the shared pieces of the router and worker pods.
The worker Deployments, the router's scaler (PDSERVE_K8S_*_DEPLOYMENT) and its Role all use
"pdserve.fullname" + "-<role>", so one helper decides every name.
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "pdserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{/* Labels of one role's objects; ctx: dict "root" $ "role" "router|prefill|decode|redis". */}}
{{- define "pdserve.roleLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .role }}
pdserve.io/role: {{ .role }}
{{- end -}}

{{- define "pdserve.roleSelector" -}}
{{ include "pdserve.selectorLabels" .root }}
pdserve.io/role: {{ .role }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.clusterSecretName" -}}
{{- default (printf "%s-cluster" (include "pdserve.fullname" .)) .Values.clusterSecret.existingSecret -}}
{{- end -}}

{{- define "pdserve.redisSecretName" -}}
{{- if .Values.redis.existingSecret -}}
{{- .Values.redis.existingSecret -}}
{{- else -}}
{{- printf "%s-redis" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Whether the pods get a Redis password from a Secret: always with the bundled Redis (the
chart makes one), with an external Redis only when redis.existingSecret names one. */}}
{{- define "pdserve.redisHasPassword" -}}
{{- if or (eq .Values.redis.mode "bundled") .Values.redis.existingSecret }}true{{ end -}}
{{- end -}}

{{/* The Redis URL the processes get: never with credentials (those come from the env). */}}
{{- define "pdserve.redisUrl" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- printf "redis://%s-redis:%d/0" (include "pdserve.fullname" .) (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* Environment every pdserve container gets: secrets by reference only, never values. */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.clusterSecretName" . }}
      key: {{ .Values.clusterSecret.key }}
{{- if include "pdserve.redisHasPassword" . }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ .Values.redis.passwordKey }}
{{- end }}
{{- if .Values.redis.username }}
- name: PDSERVE_REDIS_USERNAME
  value: {{ .Values.redis.username | quote }}
{{- end }}
- name: HOME
  value: /tmp
- name: PDSERVE_CACHE_DIR
  value: /tmp/pdserve-cache
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* Model flags shared by the router (tokenizer, name) and the workers (weights). */}}
{{- define "pdserve.modelArgs" -}}
{{- with .Values.model.path }}
- --model
- {{ . | quote }}
{{- end }}
{{- with .Values.model.tokenizer }}
- --tokenizer
- {{ . | quote }}
{{- end }}
{{- with .Values.model.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelVolumeMount" -}}
{{- if or .Values.model.pvc.claimName .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdserve.modelVolume" -}}
{{- if .Values.model.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsUser }}
fsGroup: {{ .Values.securityContext.runAsUser }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pdserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .Values.securityContext.readOnlyRootFilesystem }}
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}
