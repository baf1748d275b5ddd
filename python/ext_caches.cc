// mha._mha's KvCache and PagedKvCache classes (see mha_ext.cc).
#include "ext_common.h"

namespace mha::python {

void bind_caches(nb::module_& m) {
  nb::class_<KvCache>(m, "KvCache")
      // A cache is sized for its module's heads and dims, so only the module makes one (without
      // this, calling the class gave nanobind's TypeError "no constructor defined").
      .def("__init__",
           [](KvCache*, const nb::args&, const nb::kwargs&) {
             throw Error("KvCache: made by MultiheadAttention.make_cache(batch, capacity=0, dtype=None), not directly");
           })
      .def("length", [](const KvCache& c, const nb::handle& b) { return c.length(sequence_index(b, "length")); },
           nb::arg("b").none())
      .def("stored", [](const KvCache& c, const nb::handle& b) { return c.stored(sequence_index(b, "stored")); },
           nb::arg("b").none())
      .def_prop_ro("capacity", &KvCache::capacity)
      .def_prop_ro("batch", [](const KvCache& c) { return c.config().batch; })
      .def_prop_ro("dtype", [](const KvCache& c) { return std::string(cache_type_name(c.config().dtype)); })
      .def_prop_ro("nbytes", &KvCache::nbytes)
      .def("reset", &KvCache::reset);

  nb::class_<PagedKvCache>(m, "PagedKvCache")
      .def(
          "__init__",
          [](PagedKvCache* self, int64_t kv_heads, int64_t head_dim_qk, int64_t head_dim_v, int64_t page_size,
             int64_t pages, int64_t max_pages, int64_t window, const std::string& dtype) {
            PagedKvCacheConfig c;
            c.kv_heads = kv_heads;
            c.head_dim_qk = head_dim_qk;
            c.head_dim_v = head_dim_v;
            c.page_size = page_size;
            c.pages = pages;
            c.max_pages = max_pages;
            c.window = window;
            c.dtype = cache_type_of(dtype, "PagedKvCache");
            new (self) PagedKvCache(c);
          },
          nb::arg("kv_heads"), nb::arg("head_dim_qk"), nb::arg("head_dim_v"), nb::arg("page_size"), nb::arg("pages"),
          nb::arg("max_pages"), nb::arg("window"), nb::arg("dtype"))
      .def("add_sequence", &PagedKvCache::add_sequence)
      .def("fork", &PagedKvCache::fork, nb::arg("id"))
      .def("free_sequence", &PagedKvCache::free_sequence, nb::arg("id"))
      .def(
          "append",
          [](PagedKvCache& c, int64_t id, const In& k, const In& v) {
            c.append(id, view_of<const float>(k, "k"), view_of<const float>(v, "v"));
          },
          nb::arg("id"), nb::arg("k"), nb::arg("v"))
      .def("length", &PagedKvCache::length, nb::arg("id"))
      .def("block_table", &PagedKvCache::block_table, nb::arg("id"))
      .def("first_position", &PagedKvCache::first_position, nb::arg("id"))
      .def("sequences", &PagedKvCache::sequences)
      .def("references", &PagedKvCache::references, nb::arg("page"))
      .def("keys_as_float", [](const PagedKvCache& c, int64_t id) { return to_numpy(c.keys_as_float(id)); },
           nb::arg("id"))
      .def("values_as_float", [](const PagedKvCache& c, int64_t id) { return to_numpy(c.values_as_float(id)); },
           nb::arg("id"))
      .def_prop_ro("pages", &PagedKvCache::pages)
      .def_prop_ro("free_pages", &PagedKvCache::free_pages)
      .def_prop_ro("nbytes", &PagedKvCache::nbytes)
      .def_prop_ro("dtype", [](const PagedKvCache& c) { return std::string(cache_type_name(c.config().dtype)); })
      .def_prop_ro("head_dim_v", [](const PagedKvCache& c) { return c.config().head_dim_v; })
      .def(
          "attend",
          [](const PagedKvCache& c, const In& q, const std::vector<int64_t>& ids, const Out& out, int num_threads) {
            const View<const float> qv = view_of<const float>(q, "q");
            const View<float> ov = view_of<float>(out, "out");
            AttentionOptions o;
            o.num_threads = num_threads;
            nb::gil_scoped_release release;
            attend(qv, c, ids, ov, o);
          },
          nb::arg("q"), nb::arg("ids"), nb::arg("out"), nb::arg("num_threads") = 0);
}

}  // namespace mha::python
