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
