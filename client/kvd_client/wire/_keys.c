/* The loop of kvd_client.wire.hashing.BlockHasher.keys in C: vLLM's sha256_cbor
 * chain over every full block of one call.
 *
 * hashing.py owns the contract, validates every argument but the token ids, and
 * builds the constant CBOR parts (the array head of a block, the extra keys).
 * Here each block's encoding is laid out in one small buffer and hashed with
 * OpenSSL's SHA-256 (SHA-NI where the CPU has it):
 *
 *     83 58 20 <parent: 32 bytes> <array head> <token ids> <extras>
 *
 * Token ids come from a 1-D buffer of integers (a numpy array, any integer
 * dtype, native byte order, any stride) or from an exact list or tuple of ints.
 * Anything else, and any token id that is not an int in [0, 2**32), makes the
 * call return None without raising: hashing.py then validates with the Python
 * reference, so the errors are the reference's. The GIL is held throughout
 * (as by the Python loop): a 4,096-block call takes about half a millisecond.
 */
#define PY_SSIZE_T_CLEAN
/* SHA256_Init/Update/Final are deprecated in OpenSSL 3 in favour of EVP, whose
 * per-call fetch costs more than hashing a block; SHA256() one-shot goes through
 * that fetch too. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define KEY_SIZE SHA256_DIGEST_LENGTH
/* The widest CBOR token id: 0x1a and 4 bytes. */
#define MAX_TOKEN_BYTES 5
/* encode() stores 8 bytes per token and advances by its width. */
#define SLACK 8

static const unsigned char TRIPLE_HEAD[3] = {0x83, 0x58, 0x20};

/* How a token id is read: from an object, or an integer of a size and sign. */
enum kind { K_OBJECT, K_I8, K_U8, K_I16, K_U16, K_I32, K_U32, K_I64, K_U64 };

typedef struct {
    enum kind kind;
    PyObject *const *items; /* K_OBJECT: the list's or tuple's items */
    const char *base;       /* otherwise: the buffer */
    Py_ssize_t stride;
    Py_ssize_t n;
} Source;

/* A constant part of every block's encoding (a bytes object's contents). */
typedef struct {
    const char *p;
    Py_ssize_t len;
} Part;

#define LOAD_AS(type)                        \
    do {                                     \
        type x_;                             \
        memcpy(&x_, p, sizeof x_);           \
        /* negative ids wrap above 2**32 */  \
        u = (uint64_t)x_;                    \
    } while (0)

/* Token id i of s into *v: 0 when it is not an int in [0, 2**32). */
static inline int
load(const Source *s, Py_ssize_t i, uint32_t *v)
{
    uint64_t u;
    if (s->kind == K_OBJECT) {
        PyObject *o = s->items[i];
        int overflow;
        long long x;
        /* PyLong_Check: an int subclass is read without calling its __index__ */
        if (!PyLong_Check(o))
            return 0;
        x = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || x < 0)
            return 0;
        u = (uint64_t)x;
    }
    else {
        const char *p = s->base + i * s->stride;
        switch (s->kind) {
        case K_I8: LOAD_AS(int8_t); break;
        case K_U8: LOAD_AS(uint8_t); break;
        case K_I16: LOAD_AS(int16_t); break;
        case K_U16: LOAD_AS(uint16_t); break;
        case K_I32: LOAD_AS(int32_t); break;
        case K_U32: LOAD_AS(uint32_t); break;
        case K_I64: LOAD_AS(int64_t); break;
        default: LOAD_AS(uint64_t); break;
        }
    }
    if (u > UINT32_MAX)
        return 0;
    *v = (uint32_t)u;
    return 1;
}

/* Canonical CBOR of token ids [start, start + count) of s at out; the end, or
 * NULL on a bad token id. Writes up to SLACK bytes past the end. */
static unsigned char *
encode(const Source *s, Py_ssize_t start, Py_ssize_t count, unsigned char *out)
{
    /* Per width class (< 24, < 2**8, < 2**16, < 2**32): bytes, and the head
     * (a value below 24 is its own head). */
    static const int width[4] = {1, 2, 3, 5};
    static const uint64_t head[4] = {0, 0x18, 0x19, 0x1a};
    for (Py_ssize_t i = start; i < start + count; i++) {
        uint32_t v;
        if (!load(s, i, &v))
            return NULL;
        /* Branch-free: ids of every width mix in one block, so a branch per
         * width would mispredict on most tokens. */
        int c = (v >= 24) + (v >= 256) + (v >= 65536);
        int w = width[c];
        uint64_t word = (head[c] << (8 * (w - 1)) | v) << (8 * (8 - w));
        unsigned char be[8];
        for (int b = 0; b < 8; b++)
            be[b] = (unsigned char)(word >> (56 - 8 * b));
        memcpy(out, be, 8);
        out += w;
    }
    return out;
}

/* 1 when every token id in [start, start + count) is good. */
static int
all_valid(const Source *s, Py_ssize_t start, Py_ssize_t count)
{
    uint32_t v;
    for (Py_ssize_t i = start; i < start + count; i++)
        if (!load(s, i, &v))
            return 0;
    return 1;
}

/* The kind of a buffer's items from its struct format; -1 for anything but a
 * native-order integer (bool and char are not token ids). */
static int
buffer_kind(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN))
        f++;
    if (f[0] == '\0' || f[1] != '\0' || !strchr("bBhHiIlLqQnN", f[0]))
        return -1;
    int is_signed = f[0] >= 'a';
    switch (view->itemsize) {
    case 1: return is_signed ? K_I8 : K_U8;
    case 2: return is_signed ? K_I16 : K_U16;
    case 4: return is_signed ? K_I32 : K_U32;
    case 8: return is_signed ? K_I64 : K_U64;
    default: return -1;
    }
}

/* Hash the full blocks of s into keys (KEY_SIZE bytes each): 0, 1 on a bad
 * token id (anywhere, the partial tail too), -1 with MemoryError set. */
static int
hash_blocks(const Source *s, Py_ssize_t bs, const char *parent, Part array_head, Part extras,
            Part block0_extras, unsigned char *keys)
{
    Py_ssize_t num_blocks = s->n / bs;
    if (!all_valid(s, num_blocks * bs, s->n - num_blocks * bs))
        return 1;
    if (num_blocks == 0)
        return 0;
    Py_ssize_t most_extras = Py_MAX(extras.len, block0_extras.len);
    Py_ssize_t fixed = sizeof TRIPLE_HEAD + KEY_SIZE + array_head.len + most_extras + SLACK;
    unsigned char *buf = NULL;
    if (bs <= (PY_SSIZE_T_MAX - fixed) / MAX_TOKEN_BYTES)
        buf = PyMem_Malloc(fixed + MAX_TOKEN_BYTES * bs);
    if (!buf) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(buf, TRIPLE_HEAD, sizeof TRIPLE_HEAD);
    unsigned char *key_at = buf + sizeof TRIPLE_HEAD;
    unsigned char *tokens_at = key_at + KEY_SIZE + array_head.len;
    memcpy(key_at, parent, KEY_SIZE);
    memcpy(key_at + KEY_SIZE, array_head.p, array_head.len);
    int status = 0;
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        unsigned char *end = encode(s, b * bs, bs, tokens_at);
        if (!end) {
            status = 1;
            break;
        }
        Part x = b == 0 && block0_extras.p ? block0_extras : extras;
        memcpy(end, x.p, x.len);
        end += x.len;
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, buf, end - buf);
        /* the key is the next block's parent, in place */
        SHA256_Final(key_at, &ctx);
        memcpy(keys + b * KEY_SIZE, key_at, KEY_SIZE);
    }
    PyMem_Free(buf);
    return status;
}

/* The keys in blob as a list of bytes. */
static PyObject *
split(const char *blob, Py_ssize_t num_keys)
{
    PyObject *list = PyList_New(num_keys);
    if (!list)
        return NULL;
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        PyObject *key = PyBytes_FromStringAndSize(blob + i * KEY_SIZE, KEY_SIZE);
        if (!key) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, key);
    }
    return list;
}

/* keys(tokens, block_size, parent, array_head, extras, block0_extras) and
 * blob(...): the arguments as hashing.py checked them; None on tokens this
 * module does not take. */
static PyObject *
chain(PyObject *const *args, Py_ssize_t nargs, int as_blob)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "expected 6 arguments");
        return NULL;
    }
    PyObject *tokens = args[0];
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    if (bs < 1 || !PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) != KEY_SIZE
        || !PyBytes_Check(args[3]) || !PyBytes_Check(args[4])
        || (args[5] != Py_None && !PyBytes_Check(args[5]))) {
        PyErr_SetString(PyExc_TypeError, "bad arguments (hashing.py checks them)");
        return NULL;
    }
    Part array_head = {PyBytes_AS_STRING(args[3]), PyBytes_GET_SIZE(args[3])};
    Part extras = {PyBytes_AS_STRING(args[4]), PyBytes_GET_SIZE(args[4])};
    /* p == NULL: block 0 has no extras of its own */
    Part block0_extras = {NULL, 0};
    if (args[5] != Py_None)
        block0_extras = (Part){PyBytes_AS_STRING(args[5]), PyBytes_GET_SIZE(args[5])};

    Source s = {0};
    Py_buffer view = {0};
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        s.kind = K_OBJECT;
        s.items = PySequence_Fast_ITEMS(tokens);
        s.n = PySequence_Fast_GET_SIZE(tokens);
    }
    else {
        int kind;
        if (!PyObject_CheckBuffer(tokens))
            Py_RETURN_NONE;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_RECORDS_RO) < 0) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (view.ndim != 1 || (kind = buffer_kind(&view)) < 0) {
            PyBuffer_Release(&view);
            Py_RETURN_NONE;
        }
        s.kind = kind;
        s.base = view.buf;
        s.stride = view.strides ? view.strides[0] : view.itemsize;
        s.n = view.shape[0];
    }

    PyObject *result = NULL;
    Py_ssize_t num_blocks = s.n / bs;
    /* Allocated before the loop, which then runs no Python code and creates no
     * object: nothing can change a list under it. */
    PyObject *blob = PyBytes_FromStringAndSize(NULL, num_blocks * KEY_SIZE);
    if (blob) {
        char *keys = PyBytes_AS_STRING(blob);
        int status = hash_blocks(&s, bs, PyBytes_AS_STRING(args[2]), array_head, extras,
                                 block0_extras, (unsigned char *)keys);
        if (status == 1)
            result = Py_NewRef(Py_None);
        else if (status == 0)
            result = as_blob ? Py_NewRef(blob) : split(keys, num_blocks);
        Py_DECREF(blob);
    }
    if (view.obj)
        PyBuffer_Release(&view);
    return result;
}

static PyObject *
keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return chain(args, nargs, 0);
}

static PyObject *
blob(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return chain(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"keys", (PyCFunction)(void (*)(void))keys, METH_FASTCALL,
     "keys(tokens, block_size, parent, array_head, extras, block0_extras) -> list[bytes] | None"},
    {"blob", (PyCFunction)(void (*)(void))blob, METH_FASTCALL,
     "blob(tokens, block_size, parent, array_head, extras, block0_extras) -> bytes | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvd_client.wire._keys",
    .m_doc = "vLLM's sha256_cbor block-key chain in C (see kvd_client.wire.hashing).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__keys(void)
{
    return PyModuleDef_Init(&module);
}
