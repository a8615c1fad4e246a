/* A money amount printed as a note prints it (pipeline/note/amounts.py says the rule), as a
 * CPython extension module built by pipeline/native.py: a note prints ~140 amounts, and in
 * Python each paid for a quantize, a str() and the slicing of its commas (~0.4 us). Here it is
 * the Decimal's str() and one pass over its characters, rounded half up on the digits.
 *
 * Only what is certainly the rule's is printed here: an exact Decimal whose coefficient and
 * rounded amount fit the default context's 28 digits, its exponent within +-64, `places` 0-4.
 * Anything else (a NaN, another type, a huge or tiny exponent, a changed context's concern)
 * goes to the Python twin given to set_fallback, which behaves as it always did (raising, too).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define PRECISION 28 /* the default context's: -amount and quantize round or raise past it */
#define MAX_EXPONENT 64

static PyObject *decimal_type, *fallback, *zeros[5]; /* zeros[places]: "0", "0.0", "0.00" ... */

/* The twin's text of `amount` (of -amount when `negate`), at `places`. */
static PyObject *other(PyObject *amount, long places, int negate)
{
    if (fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "amounts: no fallback set");
        return NULL;
    }
    PyObject *value = negate ? PyNumber_Negative(amount) : Py_NewRef(amount);
    if (value == NULL)
        return NULL;
    PyObject *text = PyObject_CallFunction(fallback, "Ol", value, places);
    Py_DECREF(value);
    return text;
}

/* The coefficient's digits (leading zeros dropped) into `digits`, its exponent into *exponent
 * and its sign into *negative; -1 when `text` is not an exact Decimal's plain or scientific form. */
static int parse(const char *text, Py_ssize_t n, char *digits, int *count, long *exponent, int *negative)
{
    Py_ssize_t i = 0;
    int places = 0, point = 0;
    *count = 0;
    *negative = n > 0 && text[0] == '-';
    i = *negative;
    if (i >= n || text[i] < '0' || text[i] > '9')
        return -1; /* Infinity, NaN, sNaN */
    for (; i < n && text[i] != 'E'; i++) {
        char c = text[i];
        if (c == '.' && !point) {
            point = 1;
            continue;
        }
        if (c < '0' || c > '9')
            return -1;
        places += point;
        if (*count == 0 && c == '0')
            continue;
        if (*count >= PRECISION)
            return -1;
        digits[(*count)++] = c;
    }
    long e = 0;
    if (i < n) { /* E, a sign, digits */
        int minus = ++i < n && text[i] == '-';
        i += i < n && (text[i] == '-' || text[i] == '+');
        if (i >= n)
            return -1;
        for (; i < n; i++) {
            if (text[i] < '0' || text[i] > '9' || e > 1000000)
                return -1;
            e = e * 10 + (text[i] - '0');
        }
        e = minus ? -e : e;
    }
    *exponent = e - places;
    return *exponent < -MAX_EXPONENT || *exponent > MAX_EXPONENT ? -1 : 0;
}

/* The note's text of a Decimal `amount`, or of -amount when `negate` (exact, within 28 digits: its
 * sign flipped), at `places` (0-4). */
static PyObject *print(PyObject *amount, long places, int negate)
{
    if (Py_TYPE(amount) != (PyTypeObject *)decimal_type)
        return other(amount, places, negate);
    int truth = PyObject_IsTrue(amount);
    if (truth <= 0) { /* nought, -0 too: no brackets */
        if (truth < 0)
            return NULL;
        return Py_NewRef(zeros[places]);
    }
    PyObject *str = PyObject_Str(amount);
    if (str == NULL)
        return NULL;
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(str, &n);
    char digits[PRECISION + MAX_EXPONENT + 8];
    int count, negative;
    long exponent;
    if (text == NULL || parse(text, n, digits, &count, &exponent, &negative) < 0) {
        Py_DECREF(str);
        if (PyErr_Occurred())
            return NULL;
        return other(amount, places, negate);
    }
    Py_DECREF(str);
    negative ^= negate;
    /* to `places`: zeros appended, or digits dropped and the first dropped one rounding half up */
    if (exponent >= -places) {
        memset(digits + count, '0', exponent + places);
        count += exponent + places;
    } else {
        long drop = -places - exponent;
        int up = drop <= count && digits[count - drop] >= '5';
        count = drop >= count ? 0 : count - drop;
        int i = count - 1;
        for (; up && i >= 0; i--) {
            if (digits[i] == '9') {
                digits[i] = '0';
            } else {
                digits[i]++;
                up = 0;
            }
        }
        if (up) { /* 9...9 rounded up to 10...0 */
            memmove(digits + 1, digits, count);
            digits[0] = '1';
            count++;
        }
    }
    if (count > PRECISION)
        return other(amount, places, negate); /* quantize raises: the twin says so */
    /* count digits, the last `places` of them after the point; the whole part is at least "0" */
    char out[PRECISION * 2 + 16], *o = out;
    int whole = count - places;
    if (negative)
        *o++ = '(';
    if (whole <= 0) {
        *o++ = '0';
    } else {
        int head = whole - 3; /* digits before the thousands: in pairs, the first alone when odd */
        int i = 0;
        if (head > 0) {
            if (head % 2)
                *o++ = digits[i++];
            while (i < head) {
                if (i)
                    *o++ = ',';
                *o++ = digits[i++];
                *o++ = digits[i++];
            }
            *o++ = ',';
        }
        memcpy(o, digits + i, whole - i);
        o += whole - i;
    }
    if (places) {
        *o++ = '.';
        for (int i = whole; i < 0; i++)
            *o++ = '0';
        int from = whole > 0 ? whole : 0;
        memcpy(o, digits + from, count - from);
        o += count - from;
    }
    if (negative)
        *o++ = ')';
    return PyUnicode_DecodeASCII(out, o - out, NULL);
}

/* money(amount, places=2) */
static PyObject *money(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int whole = nargs == 1 || (nargs == 2 && PyLong_CheckExact(args[1]));
    long places = nargs == 2 && whole ? PyLong_AsLong(args[1]) : 2;
    if (!whole || places < 0 || places > 4) { /* the twin's error, or its text */
        PyErr_Clear();
        if (fallback == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "amounts: no fallback set");
            return NULL;
        }
        return PyObject_Vectorcall(fallback, args, nargs, NULL);
    }
    return print(args[0], places, 0);
}

/* column(values, charges): [money(-v) if charge else money(v) for v, charge in zip(values, charges)], both tuples
 * of one length: a column of the levies table in one call. */
static PyObject *column(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) ||
        PyTuple_GET_SIZE(args[0]) != PyTuple_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "column(values, charges): two tuples of one length");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        int negate = PyObject_IsTrue(PyTuple_GET_ITEM(args[1], i));
        PyObject *text = negate < 0 ? NULL : print(PyTuple_GET_ITEM(args[0], i), 2, negate);
        if (text == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, text);
    }
    return out;
}

static PyObject *set_fallback(PyObject *self, PyObject *fn)
{
    Py_XINCREF(fn);
    Py_XSETREF(fallback, fn);
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"money", (PyCFunction)(void (*)(void))money, METH_FASTCALL, "money(amount, places=2): the note's text of it"},
    {"column", (PyCFunction)(void (*)(void))column, METH_FASTCALL, "column(values, charges): each one's money()"},
    {"set_fallback", set_fallback, METH_O, "the Python function for what money() does not print itself"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "amounts", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit_amounts(void)
{
    PyObject *decimal = PyImport_ImportModule("decimal");
    if (decimal == NULL)
        return NULL;
    decimal_type = PyObject_GetAttrString(decimal, "Decimal");
    Py_DECREF(decimal);
    if (decimal_type == NULL)
        return NULL;
    static const char *const text[] = {"0", "0.0", "0.00", "0.000", "0.0000"};
    for (int i = 0; i < 5; i++)
        if ((zeros[i] = PyUnicode_InternFromString(text[i])) == NULL)
            return NULL;
    return PyModule_Create(&MODULE);
}
