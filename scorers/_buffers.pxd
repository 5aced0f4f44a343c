# C arrays for the compiled scoring's intermediate figures, which stay out of Python floats.
from cpython.mem cimport PyMem_Malloc


cdef inline double *doubles(Py_ssize_t n) except NULL:
    """Room for n doubles (at least one) from Python's allocator, to be given back with PyMem_Free."""
    cdef double *room = <double *>PyMem_Malloc((n if n > 0 else 1) * sizeof(double))
    if room == NULL:
        raise MemoryError()
    return room
