#!/bin/sh
# Make what docker/compose.yaml mounts: a ticket-signing secret and TLS material for the servers.
#
#   docker/make-secrets.sh [DIR] [NAME...]
#
# DIR (default docker/secrets, next to compose.yaml; git ignores it) gets
#   secret                 32 random bytes, hex: the servers' --secret-file (mounted as a compose secret)
#   tls/ca.pem             a CA made for this deployment (clients trust it: --tls-ca)
#   tls/server.pem         the servers' certificate, signed by the CA, for localhost, 127.0.0.1 and NAME...
#   tls/server-key.pem     its private key
# The server certificate must name the host clients connect to: add the host names and addresses the
# servers are reached by as NAME... (an address if it parses as IPv4 or IPv6, else a DNS name).
#
# The containers run as uid 10001: run this as root and the secret and key are chowned to it (mode 600);
# otherwise they are left readable by all (dissoc warns about the secret) so the container can read them.
# Existing files are kept: delete DIR to make new ones. Needs openssl.
set -eu

DIR="${1:-$(dirname "$0")/secrets}"
[ $# -gt 0 ] && shift
UID_IN_IMAGE="${DISSOC_UID:-10001}"

command -v openssl >/dev/null || { echo "make-secrets.sh: openssl is not installed" >&2; exit 2; }
umask 077
mkdir -p "$DIR/tls"

if [ ! -s "$DIR/secret" ]; then
    openssl rand -hex 32 > "$DIR/secret"
fi

if [ ! -s "$DIR/tls/server.pem" ]; then
    SAN="DNS:localhost,IP:127.0.0.1,IP:::1"
    for name in "$@"; do
        case "$name" in
            *:*|[0-9]*.[0-9]*.[0-9]*.[0-9]*) SAN="$SAN,IP:$name" ;;
            *) SAN="$SAN,DNS:$name" ;;
        esac
    done
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT INT TERM
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 825 \
        -subj "/O=dissoc/CN=dissoc deployment CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout "$work/ca-key.pem" -out "$DIR/tls/ca.pem" 2>/dev/null
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -subj "/O=dissoc/CN=dissoc server" -keyout "$DIR/tls/server-key.pem" -out "$work/server.csr" 2>/dev/null
    printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' \
        "$SAN" > "$work/ext.cnf"
    openssl x509 -req -in "$work/server.csr" -CA "$DIR/tls/ca.pem" -CAkey "$work/ca-key.pem" \
        -CAcreateserial -CAserial "$work/ca.srl" -days 825 -sha256 -extfile "$work/ext.cnf" -out "$DIR/tls/server.pem" 2>/dev/null
    # The CA's key is not kept: make a new DIR to add names.
fi

chmod 755 "$DIR" "$DIR/tls"
chmod 644 "$DIR/tls/ca.pem" "$DIR/tls/server.pem"
if [ "$(id -u)" = 0 ]; then
    chown "$UID_IN_IMAGE:$UID_IN_IMAGE" "$DIR/secret" "$DIR/tls/server-key.pem"
    chmod 600 "$DIR/secret" "$DIR/tls/server-key.pem"
else
    chmod 644 "$DIR/secret" "$DIR/tls/server-key.pem"
    echo "make-secrets.sh: not root: $DIR/secret and the server key are readable by all, so that the" \
        "container's user (uid $UID_IN_IMAGE) can read them; as root they are chowned to it instead" >&2
fi
echo "$DIR"
