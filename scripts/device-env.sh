# Source this on the GPU machine (carry .deps): unpacks the carried Debian
# packages under /tmp/sys and points pkg-config, the compiler and the loader at them.
#   source scripts/device-env.sh
for f in .deps/*.deb; do dpkg -x "$f" /tmp/sys; done
# libcurl (the router): only its -dev package travels; it links against the
# machine's own libcurl.so.4 (a carried runtime would need the matching libssh2,
# nghttp2, ... of Debian).
rm -f /tmp/sys/usr/lib/x86_64-linux-gnu/libcurl.so.4*
for d in /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu; do
  if [ -e $d/libcurl.so.4 ]; then ln -sf $d/libcurl.so.4 /tmp/sys/usr/lib/x86_64-linux-gnu/libcurl.so; break; fi
done
export PKG_CONFIG_PATH=/tmp/sys/usr/lib/x86_64-linux-gnu/pkgconfig:/tmp/sys/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=/tmp/sys
export LD_LIBRARY_PATH=/tmp/sys/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LIBRARY_PATH=/tmp/sys/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
export C_INCLUDE_PATH=/tmp/sys/usr/include${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}
export PATH=/tmp/sys/usr/bin:$PATH
# libmicrohttpd.pc lists gnutls as a private requirement; strata does not use
# TLS, so a stub keeps pkg-config satisfied without carrying gnutls' -dev tree.
if [ ! -f /tmp/sys/usr/lib/x86_64-linux-gnu/pkgconfig/gnutls.pc ]; then
  printf 'Name: gnutls\nDescription: stub (TLS unused)\nVersion: 3.7.9\nLibs:\nCflags:\n' \
    > /tmp/sys/usr/lib/x86_64-linux-gnu/pkgconfig/gnutls.pc
fi
# UCX with CUDA (scripts/device-debs.sh): unpacked, not on the loader's path by default.
if [ -f .deps/ucx-cu12.tar.xz ]; then
  [ -d /tmp/ucx-cu12 ] || tar xJf .deps/ucx-cu12.tar.xz -C /tmp
  export STRATA_UCX_CUDA_LIB=/tmp/ucx-cu12/libucx/lib
fi
