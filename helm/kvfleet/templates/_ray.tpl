{{/* Ray token authentication (RAY_AUTH_MODE=token): the Secret holding the token, and the env every
     Ray container (head, workers) and the controller's Ray client gets. A cluster started with it
     refuses any client without the token (issue #31 item 5). */}}
{{- define "kvfleet.rayAuthSecretName" -}}
{{- .Values.workers.rayAuth.existingSecret | default (printf "%s-ray-token" (include "kvfleet.componentName" (list . "workers"))) }}
{{- end }}

{{- define "kvfleet.rayAuthEnv" -}}
{{- if .Values.workers.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.rayAuthSecretName" . }}
      key: {{ .Values.workers.rayAuth.secretKey }}
{{- end }}
{{- end }}

{{/* The Ray pods of this release, or one node type of them ("head", "worker"). Call with (list $ TYPE). */}}
{{- define "kvfleet.raySelectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/component: workers
{{- with index . 1 }}
kvfleet.dev/ray-node-type: {{ . }}
{{- end }}
{{- end }}
