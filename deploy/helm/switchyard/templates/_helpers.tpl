{{- define "switchyard.labels" -}}
app.kubernetes.io/name: switchyard
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}
{{- define "switchyard.secretName" -}}
{{- default (printf "%s-switchyard" .Release.Name) .Values.existingSecret -}}
{{- end }}
{{- define "switchyard.webImage" -}}
{{ .Values.image.web.repository }}:{{ .Values.image.web.tag }}
{{- end }}
{{- define "switchyard.env" -}}
{{- range $k := list "DATABASE_URL" "REDIS_URL" "SECRET_KEY" "SWITCHYARD_METRICS_TOKEN" }}
- name: {{ $k }}
  valueFrom:
    secretKeyRef:
      name: {{ include "switchyard.secretName" $ }}
      key: {{ $k }}
{{- end }}
{{- if eq .Values.storage.backend "s3" }}
{{- range $k := list "AWS_ACCESS_KEY_ID" "AWS_SECRET_ACCESS_KEY" }}
- name: {{ $k }}
  valueFrom:
    secretKeyRef:
      name: {{ include "switchyard.secretName" $ }}
      key: {{ $k }}
{{- end }}
{{- end }}
{{- end }}
{{- define "switchyard.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end }}
{{- define "switchyard.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end }}

{{/*
The gpuPools value as fleet.Pool rows' fields (JSON): the ConfigMap's pools.json and the
sync-pools Job's argument (the Job runs pre-upgrade, before the ConfigMap is updated, so it
carries the new list itself).
*/}}
{{- define "switchyard.poolsJson" -}}
{{- $pools := list }}
{{- range .Values.gpuPools }}
{{- $image := default (printf "%s:%s" $.Values.image.agentCuda.repository $.Values.image.agentCuda.tag) .image }}
{{- $pools = append $pools (dict "name" (required "gpuPools[].name is required" .name) "backend" "kubernetes" "namespace" $.Release.Namespace "image" $image "node_selector" (default dict .nodeSelector) "tolerations" (default list .tolerations) "description" (default "" .description) "spot" (default false .spot)) }}
{{- end }}
{{- $pools | toJson }}
{{- end }}
