/* A shard row into a trade (pipeline/day/dumps.py's Trade.from_row), as a CPython extension
 * module built by pipeline/native.py. In Python each of a trade's 19 text fields cost a subscript,
 * a store and most an intern() call (~1.5 us a trade, a 2,000-page note's 125,000 of them), and
 * its numbers, its dict and its derived slots another ~1.5 us; here a trade's row is one call.
 * dumps.from_row_in_python is the Python twin, and does any row this does not take (not a list of
 * str, a column missing, a settlement row, a number that does not parse): made() returns None,
 * and the twin then builds the trade or raises what it raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* What made() builds a trade with, given by dumps.py when it is imported (configure): the class, its fields'
 * dict to copy and the text fields' spec (dumps._TEXT_FIELDS), Decimal, the trade settlement's code, the
 * setters of the instance's __dict__ and of its derived slots (turnover, key, order_key,
 * exchange_segment, flow), and the columns of a row's numbers and settlement type. */
enum { QUANTITY, PRICE, MULTIPLIER, CLOSE, FX, SETTLEMENT, COLUMNS };
enum { SET_DICT, SET_TURNOVER, SET_KEY, SET_ORDER_KEY, SET_EXCHANGE_SEGMENT, SET_FLOW, SETTERS };
static PyTypeObject *cls;
static PyObject *template, *decimal, *trade_code, *setters[SETTERS], *k_quantity, *k_price, *k_close,
    *k_multiplier, *k_fx, *k_settlement, *k_exchange, *k_segment, *k_trade_no, *k_order_no, *k_side;
static Py_ssize_t column[COLUMNS];
/* spec, read once: each text field's key and column, and for an interned one the last text met in
 * its column and that text interned (a note's trades repeat their exchange, segment, product...:
 * comparing with the last is cheaper than hashing the text again to find it among the interned) */
#define MAX_FIELDS 32
static Py_ssize_t fields, field_column[MAX_FIELDS];
static PyObject *field_key[MAX_FIELDS], *last_text[MAX_FIELDS], *last_interned[MAX_FIELDS];
static int field_interned[MAX_FIELDS];

static PyObject *configure(PyObject *self, PyObject *args)
{
    PyObject *type, *fields_dict, *text_spec, *decimal_type, *code, *setter_tuple, *column_tuple;
    Py_ssize_t columns[COLUMNS], keys_column[MAX_FIELDS];
    int keys_interned[MAX_FIELDS];
    if (!PyArg_ParseTuple(args, "O!O!O!OUO!O!", &PyType_Type, &type, &PyDict_Type, &fields_dict, &PyTuple_Type,
                          &text_spec, &decimal_type, &code, &PyTuple_Type, &setter_tuple, &PyTuple_Type, &column_tuple))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(text_spec);
    if (PyTuple_GET_SIZE(setter_tuple) != SETTERS || PyTuple_GET_SIZE(column_tuple) != COLUMNS || count > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "configure: 6 setters, 6 columns, at most 32 text fields");
        return NULL;
    }
    for (int i = 0; i < SETTERS; i++)
        if (Py_TYPE(PyTuple_GET_ITEM(setter_tuple, i))->tp_descr_set == NULL) {
            PyErr_SetString(PyExc_TypeError, "configure: a setter is not a data descriptor");
            return NULL;
        }
    for (int i = 0; i < COLUMNS; i++)
        if ((columns[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(column_tuple, i))) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "configure: a negative column");
            return NULL;
        }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = PyTuple_GET_ITEM(text_spec, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(entry, 0))) {
            PyErr_SetString(PyExc_TypeError, "configure: spec is (key, column, interned) a field");
            return NULL;
        }
        if ((keys_column[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1))) < 0
                || (keys_interned[i] = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 2))) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "configure: a negative column");
            return NULL;
        }
    }
    /* all checked: nothing below fails but the interning of a few names */
    PyObject *names[] = {PyUnicode_InternFromString("quantity"), PyUnicode_InternFromString("price"),
                         PyUnicode_InternFromString("close"), PyUnicode_InternFromString("multiplier"),
                         PyUnicode_InternFromString("fx"), PyUnicode_InternFromString("settlement"),
                         PyUnicode_InternFromString("exchange"), PyUnicode_InternFromString("segment"),
                         PyUnicode_InternFromString("trade_no"), PyUnicode_InternFromString("order_no"),
                         PyUnicode_InternFromString("side")};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (names[i] == NULL) {
            for (size_t j = 0; j < sizeof names / sizeof *names; j++)
                Py_XDECREF(names[j]);
            return NULL;
        }
    /* a second call (dumps imported again: a new Trade class) replaces what the first kept */
    Py_CLEAR(cls);  /* first: made() declines every row until the end */
    PyObject **kept[] = {&k_quantity, &k_price, &k_close, &k_multiplier, &k_fx, &k_settlement, &k_exchange,
                         &k_segment, &k_trade_no, &k_order_no, &k_side};
    for (size_t i = 0; i < sizeof kept / sizeof *kept; i++)
        Py_XSETREF(*kept[i], names[i]);
    for (int i = 0; i < SETTERS; i++)
        Py_XSETREF(setters[i], Py_NewRef(PyTuple_GET_ITEM(setter_tuple, i)));
    memcpy(column, columns, sizeof column);
    for (Py_ssize_t i = 0; i < MAX_FIELDS; i++) {
        Py_CLEAR(field_key[i]);
        Py_CLEAR(last_text[i]);
        Py_CLEAR(last_interned[i]);
        if (i < count) {
            field_key[i] = Py_NewRef(PyTuple_GET_ITEM(PyTuple_GET_ITEM(text_spec, i), 0));
            field_column[i] = keys_column[i], field_interned[i] = keys_interned[i];
        }
    }
    fields = count;
    Py_XSETREF(template, Py_NewRef(fields_dict));
    Py_XSETREF(decimal, Py_NewRef(decimal_type));
    Py_XSETREF(trade_code, Py_NewRef(code));
    cls = (PyTypeObject *)Py_NewRef(type);  /* last: made() takes rows from here on */
    Py_RETURN_NONE;
}

/* The trade's dict, its text fields set (as dumps.filled sets them); NULL on an error, None if a
 * column is not a str. */
static PyObject *filled_trade(PyObject *row)
{
    Py_ssize_t columns = PyList_GET_SIZE(row);
    for (Py_ssize_t i = 0; i < fields; i++)
        if (field_column[i] >= columns || !PyUnicode_CheckExact(PyList_GET_ITEM(row, field_column[i])))
            Py_RETURN_NONE;
    PyObject *d = PyDict_Copy(template);
    for (Py_ssize_t i = 0; d != NULL && i < fields; i++) {
        PyObject *value = PyList_GET_ITEM(row, field_column[i]);
        if (field_interned[i]) {
            PyObject *last = last_text[i];
            if (last != NULL && (last == value || (PyUnicode_GET_LENGTH(last) == PyUnicode_GET_LENGTH(value)
                    && PyUnicode_KIND(last) == PyUnicode_KIND(value) && memcmp(PyUnicode_DATA(last),
                    PyUnicode_DATA(value), PyUnicode_GET_LENGTH(value) * PyUnicode_KIND(value)) == 0))) {
                value = last_interned[i];
            } else {
                PyObject *interned = Py_NewRef(value);
                PyUnicode_InternInPlace(&interned);
                Py_XSETREF(last_text[i], Py_NewRef(value));
                Py_XSETREF(last_interned[i], interned);
                value = interned;
            }
        }
        if (PyDict_SetItem(d, field_key[i], value) < 0)
            Py_CLEAR(d);
    }
    return d;
}

/* The row's column `at` if it is a non-empty str, else NULL (borrowed; a column past the row's end is empty). */
static PyObject *text(PyObject *row, Py_ssize_t at)
{
    if (at >= PyList_GET_SIZE(row))
        return NULL;
    PyObject *value = PyList_GET_ITEM(row, at);
    return PyUnicode_CheckExact(value) && PyUnicode_GET_LENGTH(value) ? value : NULL;
}

/* "NSE-CM": the last pair's text again when the (interned) pair is the last one's. */
static PyObject *exchange_segment(PyObject *exchange, PyObject *segment)
{
    static PyObject *last_exchange, *last_segment, *last;
    if (last == NULL || exchange != last_exchange || segment != last_segment) {
        PyObject *text = PyUnicode_FromFormat("%U-%U", exchange, segment);
        if (text == NULL)
            return NULL;
        Py_XSETREF(last, text);
        Py_XSETREF(last_exchange, Py_NewRef(exchange));
        Py_XSETREF(last_segment, Py_NewRef(segment));
    }
    return Py_NewRef(last);
}

static int set(int setter, PyObject *t, PyObject *value)
{
    int failed = value == NULL || Py_TYPE(setters[setter])->tp_descr_set(setters[setter], t, value) < 0;
    Py_XDECREF(value);
    return failed;
}

/* made(row) -> the Trade from_row builds of a trade's row (its settlement T, or none given), the same
 * fields, values and derived slots; None for any other row, and on any error (the twin raises it). */
static PyObject *made(PyObject *self, PyObject *row)
{
    if (cls == NULL || !PyList_CheckExact(row) || PyList_GET_SIZE(row) <= column[MULTIPLIER] + 1)
        Py_RETURN_NONE;
    PyObject *settlement = text(row, column[SETTLEMENT]);
    if (column[SETTLEMENT] < PyList_GET_SIZE(row)
            && (settlement == NULL || PyUnicode_Compare(settlement, trade_code) != 0))
        goto decline;  /* a settlement row, or an empty type: the twin's */
    static const int numbers[] = {QUANTITY, PRICE, MULTIPLIER, CLOSE, FX};
    for (int i = 0; i < 5; i++)
        if (column[numbers[i]] < PyList_GET_SIZE(row) && !PyUnicode_CheckExact(PyList_GET_ITEM(row, column[numbers[i]])))
            goto decline;
    PyObject *quantity_text = text(row, column[QUANTITY]), *price_text = text(row, column[PRICE]);
    if (quantity_text == NULL || price_text == NULL)
        goto decline;
    PyObject *d = filled_trade(row);
    if (d == NULL || d == Py_None) {
        Py_XDECREF(d);
        goto decline;
    }
    PyObject *multiplier_text = text(row, column[MULTIPLIER]), *close_text = text(row, column[CLOSE]);
    PyObject *fx_text = text(row, column[FX]);
    PyObject *quantity = PyLong_FromUnicodeObject(quantity_text, 10);
    PyObject *price = PyObject_CallOneArg(decimal, price_text);
    PyObject *multiplier = multiplier_text ? PyLong_FromUnicodeObject(multiplier_text, 10) : PyLong_FromLong(1);
    PyObject *close = close_text ? PyObject_CallOneArg(decimal, close_text) : Py_NewRef(Py_None);
    PyObject *fx = fx_text ? PyObject_CallOneArg(decimal, fx_text) : Py_NewRef(Py_None);
    PyObject *t = NULL, *value = NULL;
    if (quantity == NULL || price == NULL || multiplier == NULL || close == NULL || fx == NULL
            || PyDict_SetItem(d, k_quantity, quantity) < 0 || PyDict_SetItem(d, k_price, price) < 0
            || PyDict_SetItem(d, k_close, close) < 0 || PyDict_SetItem(d, k_multiplier, multiplier) < 0
            || PyDict_SetItem(d, k_fx, fx) < 0 || PyDict_SetItem(d, k_settlement, trade_code) < 0)
        goto done;
    /* the turnover as _derive works it out: price x quantity (x multiplier, unless 1), then x fx */
    int overflow, unit = PyLong_AsLongAndOverflow(multiplier, &overflow) == 1 && !overflow;
    value = PyNumber_Multiply(price, quantity);
    if (value != NULL && !unit)
        Py_SETREF(value, PyNumber_Multiply(value, multiplier));
    if (value != NULL && fx != Py_None)
        Py_SETREF(value, PyNumber_Multiply(value, fx));
    if (value == NULL || (t = cls->tp_alloc(cls, 0)) == NULL)
        goto done;
    /* the fields from d, which holds them (the row's cells, or their interned texts) */
    PyObject *exchange = PyDict_GetItemWithError(d, k_exchange), *segment = PyDict_GetItemWithError(d, k_segment);
    PyObject *trade_no = PyDict_GetItemWithError(d, k_trade_no), *order_no = PyDict_GetItemWithError(d, k_order_no);
    PyObject *side = PyDict_GetItemWithError(d, k_side);
    if (exchange == NULL || segment == NULL || trade_no == NULL || order_no == NULL || side == NULL
            || set(SET_DICT, t, Py_NewRef(d))
            || set(SET_TURNOVER, t, Py_NewRef(value))
            || set(SET_FLOW, t, Py_NewRef(side))
            || set(SET_KEY, t, PyTuple_Pack(3, exchange, segment, trade_no))
            || set(SET_ORDER_KEY, t, PyTuple_Pack(3, exchange, segment, order_no))
            || set(SET_EXCHANGE_SEGMENT, t, exchange_segment(exchange, segment)))
        Py_CLEAR(t);
done:
    Py_DECREF(d);
    Py_XDECREF(quantity), Py_XDECREF(price), Py_XDECREF(multiplier), Py_XDECREF(close), Py_XDECREF(fx);
    Py_XDECREF(value);
    if (t != NULL)
        return t;
decline:
    PyErr_Clear();
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"configure", configure, METH_VARARGS, "configure(cls, template, spec, decimal, trade, setters, columns)"},
    {"made", made, METH_O, "made(row): the trade of a trade's row, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "rows", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit_rows(void)
{
    return PyModule_Create(&MODULE);
}
