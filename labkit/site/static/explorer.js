/* labkit's explorers on a static page: step through the pictures drawn when the site was built.
   Each .lk-explorer holds its data (controls, frames in row-major order) in a JSON script element;
   this script adds a <select> or a range input per control, and swaps the picture and the summary.
   It also makes every output picture a link to itself (a figure shrunk to a phone opens whole). */
(function () {
  "use strict";

  function setUp(root) {
    var data = JSON.parse(root.querySelector("script.lk-explorer-data").textContent);
    var picture = root.querySelector("img.lk-explorer-picture");
    var link = root.querySelector("a.lk-picture-link");
    var summary = root.querySelector(".lk-explorer-summary");
    var holder = root.querySelector(".lk-explorer-controls");
    var sizes = data.controls.map(function (c) { return c.labels.length; });
    var index = [];
    var rest = data.opening;
    for (var k = sizes.length - 1; k >= 0; k--) { index[k] = rest % sizes[k]; rest = Math.floor(rest / sizes[k]); }
    var readouts = [];
    var inputs = [];

    function frame(at) {
      var flat = 0;
      for (var k = 0; k < sizes.length; k++) { flat = flat * sizes[k] + at[k]; }
      return data.frames[flat];
    }

    // The last value of control k that the widget keeps as asked, the others as they are (lesson 01's ring has
    // fewer steps on fewer ranks): a range input stops there.
    function limit(k) {
      var at = index.slice();
      for (var j = sizes[k] - 1; j > 0; j--) {
        at[k] = j;
        if (!frame(at).clamped[k]) { return j; }
      }
      return 0;
    }

    function show() {
      for (var k = 0; k < inputs.length; k++) {
        if (inputs[k].type === "range") {
          var last = limit(k);
          inputs[k].max = last;
          if (index[k] > last) { index[k] = last; }
          inputs[k].value = index[k];
        }
      }
      var current = frame(index);
      var source = "_explorers/" + current.picture + ".png";
      picture.src = source;
      picture.alt = picture.alt.split(":")[0] + ": " + current.shown.join(", ");
      if (link) { link.href = source; }
      summary.innerHTML = current.summary;
      for (var k2 = 0; k2 < readouts.length; k2++) {
        if (readouts[k2]) { readouts[k2].textContent = current.shown[k2]; }
      }
      root.setAttribute("data-frame", current.picture);
    }

    data.controls.forEach(function (control, k) {
      var label = document.createElement("label");
      label.className = "lk-control";
      var name = document.createElement("span");
      name.className = "lk-control-name";
      name.textContent = control.description;
      label.appendChild(name);
      var input;
      if (control.kind === "range") {
        input = document.createElement("input");
        input.type = "range";
        input.min = 0;
        input.max = control.labels.length - 1;
        input.step = 1;
        input.value = index[k];
        var readout = document.createElement("output");
        readout.className = "lk-control-value";
        readouts[k] = readout;
        label.appendChild(input);
        label.appendChild(readout);
      } else {
        input = document.createElement("select");
        control.labels.forEach(function (text, j) {
          var option = document.createElement("option");
          option.value = j;
          option.textContent = text;
          input.appendChild(option);
        });
        input.value = index[k];
        label.appendChild(input);
      }
      input.setAttribute("aria-label", control.description);
      input.addEventListener("input", function () { index[k] = parseInt(input.value, 10); show(); });
      inputs.push(input);
      holder.appendChild(label);
    });
    show();
  }

  // A figure shrunk to a phone's width opens whole in a tab of its own: each output picture links to itself.
  function linkPictures() {
    var pictures = document.querySelectorAll(".cell_output img");
    for (var i = 0; i < pictures.length; i++) {
      var img = pictures[i];
      if (img.closest("a")) { continue; }
      var a = document.createElement("a");
      a.href = img.getAttribute("src");
      a.target = "_blank";
      a.className = "lk-picture-link";
      img.parentNode.insertBefore(a, img);
      a.appendChild(img);
    }
  }

  function start() {
    var explorers = document.querySelectorAll(".lk-explorer[data-key]");
    for (var i = 0; i < explorers.length; i++) { setUp(explorers[i]); }
    linkPictures();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
