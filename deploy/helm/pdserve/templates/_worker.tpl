{{/*
One worker role's Deployment; ctx: dict "root" $ "role" "prefill|decode".

Probes are the worker's own truth on its metrics port (worker_runtime/probes.py):
  startup   /startupz  the model is loaded and the gRPC server serves
  readiness /readyz    registered in Redis, engine loop alive, not draining
  liveness  /livez     the engine loop makes progress whenever it has work
Termination: Kubernetes sends SIGTERM, the worker marks itself draining in Redis (routers stop
choosing it), finishes or ends its in-flight requests within drainTimeout, then exits; the
grace period is drainTimeout + 15 s so SIGKILL never cuts a drain short.
*/}}
{{- define "pdserve.worker" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $v := index $root.Values $role -}}
{{- $engine := mergeOverwrite (deepCopy $root.Values.engine) ($v.engine | default dict) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.fullname" $root }}-{{ $role }}
  labels:
    {{- include "pdserve.roleLabels" . | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 3
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "pdserve.roleSelector" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.roleLabels" . | nindent 8 }}
      annotations:
        checksum/secrets: {{ include (print $root.Template.BasePath "/secrets.yaml") $root | sha256sum | trunc 16 | quote }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ add (int $v.drainTimeout) 15 }}
      securityContext:
        {{- include "pdserve.podSecurityContext" $root | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["pdserve"]
          args:
            - {{ $role }}
            - --host
            - 0.0.0.0
            - --advertise-host
            - $(POD_IP)
            - --port
            - "50051"
            - --metrics-port
            - "9100"
            - --link-port
            - "50052"
            - --worker-id
            - $(POD_NAME)
            - --redis-url
            - {{ include "pdserve.redisUrl" $root | quote }}
            - --cluster
            - {{ $root.Values.cluster | quote }}
            - --drain-timeout
            - {{ $v.drainTimeout | quote }}
            - --liveness-stall
            - {{ $v.livenessStall | quote }}
            {{- with (include "pdserve.modelArgs" $root | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- with (include "pdserve.engineArgs" $engine | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- include "pdserve.commonEnv" $root | nindent 12 }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: 50051
              protocol: TCP
            - name: link
              containerPort: 50052
              protocol: TCP
            - name: metrics
              containerPort: 9100
              protocol: TCP
          startupProbe:
            httpGet: {path: /startupz, port: metrics}
            periodSeconds: 5
            failureThreshold: {{ $v.startupFailureThreshold }}
          readinessProbe:
            httpGet: {path: /readyz, port: metrics}
            periodSeconds: 5
            failureThreshold: 2
          livenessProbe:
            httpGet: {path: /livez, port: metrics}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- include "pdserve.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $v.shmSize }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            {{- with (include "pdserve.modelVolumeMount" $root | trim) }}{{ . | nindent 12 }}{{ end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- if $v.shmSize }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSize }}
        {{- end }}
        {{- with (include "pdserve.modelVolume" $root | trim) }}{{ . | nindent 8 }}{{ end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* Engine flags from a merged engine block: camelCase key -> --kebab-case flag, null left
out, booleans as --name / --no-name; kvTransfer is the worker's --kv-transfer. */}}
{{- define "pdserve.engineArgs" -}}
{{- range $key := keys . | sortAlpha }}
{{- $value := index $ $key }}
{{- if kindIs "bool" $value }}
- {{ ternary (printf "--%s" (kebabcase $key)) (printf "--no-%s" (kebabcase $key)) $value }}
{{- else if not (kindIs "invalid" $value) }}
- --{{ kebabcase $key }}
{{- if and (kindIs "float64" $value) (eq (float64 (int64 $value)) $value) }}
- {{ int64 $value | quote }}
{{- else }}
- {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
