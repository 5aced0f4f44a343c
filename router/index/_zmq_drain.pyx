# cython: language_level=3, boundscheck=False, wraparound=False
"""The messages a ZMQ socket has queued, received in C: the subscriber's drain (router/index/subscriber.py).

pyzmq's recv_multipart costs about 4 µs a message of three frames (a Python call and an option read per
frame); following a fleet's events one block a message, that was a third of the subscriber's time. This calls
libzmq's zmq_msg_recv directly, 0.3 µs a message, on the socket pyzmq made. The functions must be those of
the libzmq pyzmq uses (another copy in the process could not use its sockets): they are looked up by name
from pyzmq's extension, which finds them in the libzmq it links, shared (its wheels' own, or the system's) or
static.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uintptr_t

import zmq  # loads libzmq, which this module uses
from zmq.backend.cython import _zmq as _pyzmq_extension

cdef extern from *:
    """
    #include <dlfcn.h>
    #include <errno.h>

    /* Room for libzmq's zmq_msg_t: opaque, 64 bytes aligned as a pointer since libzmq 4.1, less before. */
    typedef struct { void *aligned[8]; } zmq_drain_msg;

    static int (*zmq_drain_msg_init)(zmq_drain_msg *);
    static int (*zmq_drain_msg_recv)(zmq_drain_msg *, void *, int);
    static void *(*zmq_drain_msg_data)(zmq_drain_msg *);
    static size_t (*zmq_drain_msg_size)(const zmq_drain_msg *);
    static int (*zmq_drain_msg_more)(const zmq_drain_msg *);
    static int (*zmq_drain_msg_close)(zmq_drain_msg *);
    static int (*zmq_drain_errno)(void);

    /* Binds the functions above to those `extension` (pyzmq's, loaded already) resolves: its own symbols,
       then its dependencies', the libzmq it links among them. 0, or -1 when they are not found. */
    static int zmq_drain_bind(const char *extension) {
        void *library = dlopen(extension, RTLD_NOW | RTLD_NOLOAD);
        if (library == NULL)
            return -1;
        *(void **)&zmq_drain_msg_init = dlsym(library, "zmq_msg_init");
        *(void **)&zmq_drain_msg_recv = dlsym(library, "zmq_msg_recv");
        *(void **)&zmq_drain_msg_data = dlsym(library, "zmq_msg_data");
        *(void **)&zmq_drain_msg_size = dlsym(library, "zmq_msg_size");
        *(void **)&zmq_drain_msg_more = dlsym(library, "zmq_msg_more");
        *(void **)&zmq_drain_msg_close = dlsym(library, "zmq_msg_close");
        *(void **)&zmq_drain_errno = dlsym(library, "zmq_errno");
        return zmq_drain_msg_init && zmq_drain_msg_recv && zmq_drain_msg_data && zmq_drain_msg_size
            && zmq_drain_msg_more && zmq_drain_msg_close && zmq_drain_errno ? 0 : -1;
    }
    """
    ctypedef struct zmq_drain_msg:
        pass
    int zmq_drain_bind(const char *extension)
    int zmq_drain_msg_init(zmq_drain_msg *)
    int zmq_drain_msg_recv(zmq_drain_msg *, void *, int) nogil
    void *zmq_drain_msg_data(zmq_drain_msg *)
    size_t zmq_drain_msg_size(const zmq_drain_msg *)
    int zmq_drain_msg_more(const zmq_drain_msg *)
    int zmq_drain_msg_close(zmq_drain_msg *)
    int zmq_drain_errno()
    int EAGAIN, EINTR

cdef enum:
    _DONTWAIT = 1  # ZMQ_DONTWAIT

if zmq_drain_bind(_pyzmq_extension.__file__.encode()) != 0:
    raise ImportError(f"libzmq's functions are not found in this process (pyzmq {zmq.__version__})")


cdef int _receive(void *socket, zmq_drain_msg *message, bint first) except -1:
    """0: message holds the socket's next frame, for the caller to close; 1: none is queued (first only: a
    message's frames arrive together, so a later one never waits)."""
    cdef int error
    while True:
        zmq_drain_msg_init(message)
        if zmq_drain_msg_recv(message, socket, _DONTWAIT) >= 0:
            return 0
        error = zmq_drain_errno()
        zmq_drain_msg_close(message)
        if error == EINTR:
            continue
        if error == EAGAIN and first:
            return 1
        raise _error(error)


cdef object _error(int error):
    """The exception pyzmq raises for error."""
    if error == EAGAIN:
        return zmq.Again(error)
    if error == zmq.ETERM:
        return zmq.ContextTerminated(error)
    return zmq.ZMQError(error)


def drain(uintptr_t socket, Py_ssize_t most, Py_ssize_t most_bytes):
    """Up to most of the messages the socket (pyzmq's Socket.underlying) has queued, as lists of frames,
    without waiting; no more once they hold most_bytes. The caller keeps the socket open meanwhile."""
    cdef list messages = [], frames
    cdef Py_ssize_t size = 0
    cdef void *handle = <void *>socket
    cdef zmq_drain_msg message
    cdef char *data
    cdef bint more
    while len(messages) < most and size < most_bytes:
        if _receive(handle, &message, True):
            break
        frames = []
        while True:
            try:
                data = <char *>zmq_drain_msg_data(&message)
                frame = PyBytes_FromStringAndSize(data, zmq_drain_msg_size(&message))
                more = zmq_drain_msg_more(&message)
            finally:
                zmq_drain_msg_close(&message)
            frames.append(frame)
            size += len(frame)
            if not more:
                break
            _receive(handle, &message, False)
        messages.append(frames)
    return messages
