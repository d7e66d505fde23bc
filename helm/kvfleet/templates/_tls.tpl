{{/*
TLS client files of the proxy and the watcher job: the CA that signed the controller's certificate
(only ca.crt of tls.secretName, never the server's key) and, with tls.clientCa (mutual TLS), their
own client certificate from tls.clientSecretName.
*/}}
{{- define "kvfleet.tlsClientMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls-ca
  mountPath: /etc/kvfleet/tls
  readOnly: true
{{- if .Values.tls.clientCa }}
- name: tls-client
  mountPath: /etc/kvfleet/tls-client
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "kvfleet.tlsClientVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls-ca
  secret:
    secretName: {{ .Values.tls.secretName }}
    items:
      - key: ca.crt
        path: ca.crt
    optional: true
{{- if .Values.tls.clientCa }}
- name: tls-client
  secret:
    secretName: {{ .Values.tls.clientSecretName }}
{{- end }}
{{- end }}
{{- end }}
